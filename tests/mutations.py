"""How the property tests damage network input: byte-level edits of a wire
form, and structural edits of a record's content before it is re-signed (what a
signer could put there). Shared by every decoder's fuzz tests."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st


def mutate_bytes(data, buf: bytes) -> bytes:
    """Up to four byte-level edits: flips, overwrites, insertions, deletions, a truncation."""
    b = bytearray(buf)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "flip" and b:
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "set" and b:
            b[i] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xD4, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif op == "insert":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and b:
            del b[i:i + data.draw(st.integers(1, 8))]
        elif op == "truncate":
            del b[i:]
    return bytes(b)


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a nested dict/list, the root first."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, prefix + (i,))
    return out


def at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate_tree(data, content: dict, edits: int, values) -> Any:
    """``edits`` structural edits anywhere in a nested record: replace a value (with
    one drawn from ``values``, or a copy of another part of the record), delete a
    key or item, add one, or (rarely) replace the whole record."""
    content = copy.deepcopy(content)
    for _ in range(edits):
        places = paths(content)
        op = data.draw(st.sampled_from(["replace"] * 4 + ["copy"] * 2 + ["delete"] * 2 + ["add"] * 2 + ["root"]))
        if op == "root":
            content = copy.deepcopy(data.draw(values))  # (drawn values may be a strategy's own objects:
            continue  # edited in place, they would change what later examples draw)
        path = data.draw(st.sampled_from(places if op == "add" or len(places) == 1 else places[1:]))
        if op in ("replace", "copy") and path:
            value = copy.deepcopy(data.draw(values) if op == "replace" else at(content, data.draw(st.sampled_from(places))))
            at(content, path[:-1])[path[-1]] = value
        elif op == "delete" and path:
            del at(content, path[:-1])[path[-1]]
        elif op == "add":
            target = at(content, path)
            if isinstance(target, dict):
                target[data.draw(st.text(max_size=12))] = copy.deepcopy(data.draw(values))
            elif isinstance(target, list):
                target.insert(data.draw(st.integers(0, len(target))), copy.deepcopy(data.draw(values)))
    return content
