"""Timestamps on a token's path, off by default (issue 27; docs/ring.md, "Trace").

``MESHNET_TRACE=FILE`` in a process's environment makes it append one JSON line
per event to FILE: ``{"t": ns, "pid": ..., "who": ..., "ev": ..., ...fields}``.
``t`` is CLOCK_MONOTONIC in nanoseconds, one clock for every process of a
machine, so the events of a client and its peers order into one timeline. Each
line is one ``write`` on a file opened ``O_APPEND``: lines of several processes
never interleave. When the variable is unset, :func:`event` is one global read
and a return: nothing on the token's path pays for tracing it does not do.
"""

from __future__ import annotations

import json
import os
import sys
import time

ENV = "MESHNET_TRACE"
_fd: int | None = None
_who = ""


def start(path: str | None) -> None:
    """Trace to ``path`` from now on (None: stop)."""
    global _fd
    if _fd is not None:
        os.close(_fd)
        _fd = None
    if path:
        try:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:  # a trace that cannot be written must not stop the process it watches
            sys.stderr.write(f"warning: {ENV}={path!r} cannot be written ({e.strerror or e}); not tracing\n")


def enabled() -> bool:
    return _fd is not None


def name(who: str) -> None:
    """What this process is in the trace (``client``, ``peer 0:10``...)."""
    global _who
    _who = who


def event(ev: str, **fields) -> None:
    """One event now, with ``fields`` (JSON scalars)."""
    if _fd is None:
        return
    line = json.dumps({"t": time.monotonic_ns(), "pid": os.getpid(), "who": _who, "ev": ev, **fields},
                      separators=(",", ":"))
    os.write(_fd, line.encode() + b"\n")


start(os.environ.get(ENV))
