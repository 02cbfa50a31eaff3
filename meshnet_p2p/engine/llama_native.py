"""The ctypes glue between llama-cpp-python's low-level API and our native hooks.

Kept apart from the engine so the engine reads as shard logic, not as pointer
plumbing. Everything llama.cpp-version-specific that is not a public
``llama_*`` call lives here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading

import llama_cpp

_lock = threading.Lock()
_backend_ready = False


class CaptureState(ctypes.Structure):
    # Mirrors meshnet_capture_state in _llama_hooks.c, field for field.
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("target", ctypes.c_char * 64),
        ("buf", ctypes.c_void_p),
        ("cap", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("captures", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("abort", ctypes.c_int32),
        ("stop_after", ctypes.c_int32),
    ]


class Hooks:
    """Function pointers to the native capture and abort callbacks."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("meshnet_p2p.engine._llama_hooks")
        if spec is None or not spec.origin:
            raise ImportError(
                "the native hooks extension meshnet_p2p.engine._llama_hooks is not built; reinstall the package (pip install -e .)"
            )
        lib = ctypes.CDLL(spec.origin)
        lib.meshnet_capture_state_size.restype = ctypes.c_size_t
        if lib.meshnet_capture_state_size() != ctypes.sizeof(CaptureState):
            raise ImportError("native hooks and CaptureState disagree on layout; rebuild the extension")
        self.lib = lib
        ggml = ggml_base()
        self.get_name = ctypes.cast(ggml.ggml_get_name, ctypes.c_void_p).value
        self.nbytes = ctypes.cast(ggml.ggml_nbytes, ctypes.c_void_p).value
        self.tensor_get = ctypes.cast(ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
        self.eval_cb = llama_cpp.ggml_backend_sched_eval_callback(
            ctypes.cast(lib.meshnet_capture_eval, ctypes.c_void_p).value
        )
        self.abort_cb = llama_cpp.ggml_abort_callback(ctypes.cast(lib.meshnet_abort_check, ctypes.c_void_p).value)

    def new_state(self) -> CaptureState:
        state = CaptureState()
        state.get_name = self.get_name
        state.nbytes = self.nbytes
        state.tensor_get = self.tensor_get
        return state


def ggml_base() -> ctypes.CDLL:
    """libggml-base as libllama maps it. The wheel ships ``.so``, ``.so.0`` and
    ``.so.0.25.3`` as separate copies; ``.so.0`` is the one libllama links
    against, and loading another copy would give a second, unrelated ggml."""
    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so.0"))


@functools.lru_cache(maxsize=1)
def native_build() -> str:
    """What the running llama.cpp and ggml report of themselves (not the Python
    binding's version), e.g. ``"ggml 0.25.3 (0c1e570-dirty), llama 0.5.0-dev"``."""
    ggml = ggml_base()
    ggml.ggml_version.restype = ctypes.c_char_p
    ggml.ggml_version.argtypes = []
    ggml.ggml_commit.restype = ctypes.c_char_p
    ggml.ggml_commit.argtypes = []
    # llama_version through the binding's own handle: the binding maps
    # libllama.so, and opening libllama.so.0 would map a second copy.
    llama = llama_cpp.llama_version()
    return f"ggml {ggml.ggml_version().decode()} ({ggml.ggml_commit().decode()}), llama {llama.decode()}"


def system_info() -> str:
    """``llama_print_system_info()`` after backend init: per backend, the
    features ggml compiled in and selected (``CPU : SSE3 = 1 | AVX2 = 1 | ...``)."""
    ensure_backend()
    return llama_cpp.llama_print_system_info().decode()


_hooks: Hooks | None = None


def hooks() -> Hooks:
    global _hooks
    with _lock:
        if _hooks is None:
            _hooks = Hooks()
        return _hooks


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and silence its log on stderr
    unless MESHNET_LLAMA_LOG is set (it prints hundreds of lines per load)."""
    global _backend_ready
    with _lock:
        if _backend_ready:
            return
        llama_cpp.llama_backend_init()
        if not os.environ.get("MESHNET_LLAMA_LOG"):
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p())
        _backend_ready = True


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


def token_piece(vocab: ctypes.c_void_p, token: int) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return buf.raw[: max(n, 0)]


def tokenize(vocab: ctypes.c_void_p, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
    raw = text.encode("utf-8")
    cap = len(raw) + 16
    for _ in range(2):
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), arr, cap, add_special, parse_special)
        if n >= 0:
            return list(arr[:n])
        cap = -n
    raise RuntimeError("llama_tokenize did not converge")
