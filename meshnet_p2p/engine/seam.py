"""Hidden-state encodings at a shard boundary (the seam dtype, a recipe axis).

float32 is exact and the default. float16 and bfloat16 halve the bytes on the
wire but change the generated text; they exist for recipes that accept that,
and are never mixed with float32 on one route (the recipe digest differs).
"""

from __future__ import annotations

import numpy as np

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def seam_itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def encode_seam(rows: np.ndarray, dtype: str) -> bytes:
    """float32 rows -> wire bytes (little-endian, row-major)."""
    if dtype == "f32":
        return rows.astype("<f4", copy=False).tobytes()
    if dtype == "f16":
        return rows.astype("<f2").tobytes()
    if dtype == "bf16":
        bits = rows.astype("<f4", copy=False).view("<u4").astype(np.uint64)
        # round to nearest, ties to even, as hardware bf16 conversion does
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.astype("<u2").tobytes()
    raise ValueError(f"unknown seam dtype {dtype!r}")


def decode_seam(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Wire bytes -> float32 rows of ``shape``."""
    if dtype == "f32":
        return np.frombuffer(data, dtype="<f4").reshape(shape)
    if dtype == "f16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == "bf16":
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4").reshape(shape)
    raise ValueError(f"unknown seam dtype {dtype!r}")
