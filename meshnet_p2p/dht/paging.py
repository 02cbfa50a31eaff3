"""Reading a key's values in parallel pages: pure arithmetic on signer order.

A home answers ``find_value`` with a key's records ordered by their signer's
multihash, one datagram (``REPLY_BUDGET_BYTES``) at a time, and a cursor
(``after``) pages on. Read one page after another, a model key of 256
volunteers' reports costs a reader several round trips to each home it asks,
one after the other: most of a model lookup's time at thousands of peers
(docs/scale.md).

Signers are Ed25519 public keys, so their multihashes spread evenly over
their order. The first page tells how densely: it holds ``n`` records up to
the signer at position ``p`` (a fraction of the key space), so about
``n (1 - p) / p`` are left. :func:`split_rest` cuts what is left into ranges
``(after, upto]`` that each fit a page at that density, all asked at once;
a range that held more than its share pages on by its own cursor. A signer
ground to crowd one range only makes that range page on (each home's pages
stay bounded by ``DHTConfig.max_pages``).
"""

from __future__ import annotations

from meshnet_p2p.core.identity import ED25519_MULTIHASH_PREFIX as ED25519_PREFIX

_POSITION_BYTES = 8  # a cursor: the prefix and this much of a key (bytes compare in order)
FILL = 0.6  # a range is cut to hold this share of a first page, so a denser one still fits one page


def position(multihash: bytes) -> float | None:
    """Where an Ed25519 signer sits in the key space, in [0, 1); None for any
    other kind of signer (no estimate: the rest is read one page after another)."""
    if len(multihash) != len(ED25519_PREFIX) + 32 or not multihash.startswith(ED25519_PREFIX):
        return None
    start = len(ED25519_PREFIX)
    return int.from_bytes(multihash[start:start + _POSITION_BYTES], "big") / 2 ** (8 * _POSITION_BYTES)


def cursor_at(fraction: float) -> bytes:
    """A cursor that orders after every Ed25519 signer below ``fraction`` of the
    key space and before every one above it."""
    top = 2 ** (8 * _POSITION_BYTES) - 1
    return ED25519_PREFIX + min(top, max(0, int(fraction * 2 ** (8 * _POSITION_BYTES)))).to_bytes(_POSITION_BYTES, "big")


def split_rest(last: bytes, first_page: int, most: int) -> list[tuple[bytes, bytes | None]]:
    """The ranges ``(after, upto]`` to ask for at once once a first page of
    ``first_page`` records ended at signer ``last`` with more to come: together
    every signer after ``last``, the last range open-ended (``upto`` None), at
    most ``most`` ranges (at least one)."""
    p = position(last)
    if p is None or first_page < 1 or most <= 1 or p <= 0.0:
        return [(last, None)]
    left = first_page * (1.0 - p) / p  # records expected after ``last`` at the first page's density
    parts = max(1, min(most, -(-int(left) // max(1, int(first_page * FILL)))))
    width = (1.0 - p) / parts
    bounds = [last]
    for i in range(1, parts):
        b = cursor_at(p + i * width)
        if b > bounds[-1]:  # a rounding that repeats a bound would make an empty range: skip it
            bounds.append(b)
    return [(a, b) for a, b in zip(bounds, bounds[1:])] + [(bounds[-1], None)]
