"""Keep a machine's CPUs awake while a session's next step is due.

Why: between two steps of a decode a hop sits idle for the rest of the
route's period (the other hops' compute and the link delays). Once that idle
is longer than a few milliseconds the CPUs sleep (a VM's vCPU halts into the
hypervisor; bare metal drops into a deep C-state and a lower clock), and the
next step pays for it: on this project's 2-core VM a 10-layer step took
10-12 ms after 25 ms idle against 3 ms when the CPUs stayed busy (docs/ring.md,
"Trace"). llama.cpp's own threadpool polls before sleeping for the same reason.

What: ``touch()`` after every step keeps ``threads`` native threads spinning
(engine/_keepwarm.c) for ``window`` seconds more. They run at SCHED_IDLE, so
any other runnable thread of the machine preempts them at once: they spend
only CPU time nothing else wants, and none while the session's own compute
runs. The price is power: up to ``threads`` busy CPUs while steps keep coming
and for one window after the last; ``stats()`` counts it, and
``--keep-warm 0`` turns it off.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from dataclasses import dataclass

DEFAULT_WINDOW_S = 0.25  # longer than a ring's period at 15 ms links (~55 ms) or a star's (~100 ms)

_lock = threading.Lock()
_lib = None


def _native():
    global _lib
    with _lock:
        if _lib is None:
            spec = importlib.util.find_spec("meshnet_p2p.engine._keepwarm")
            if spec is None or not spec.origin:
                raise ImportError("the native extension meshnet_p2p.engine._keepwarm is not built; "
                                  "reinstall the package (pip install -e .)")
            lib = ctypes.CDLL(spec.origin)
            lib.meshnet_keepwarm_start.argtypes = [ctypes.c_int]
            lib.meshnet_keepwarm_start.restype = ctypes.c_int
            lib.meshnet_keepwarm_until.argtypes = [ctypes.c_int64]
            lib.meshnet_keepwarm_until.restype = None
            lib.meshnet_keepwarm_stop.restype = None
            lib.meshnet_keepwarm_now_ns.restype = ctypes.c_int64
            lib.meshnet_keepwarm_deadline_ns.restype = ctypes.c_int64
            lib.meshnet_keepwarm_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
            lib.meshnet_keepwarm_stats.restype = None
            _lib = lib
        return _lib


@dataclass(frozen=True)
class KeepWarmStats:
    threads: int
    idle_policy: bool | None  # SCHED_IDLE granted (None: no thread has started yet)
    spun_s: float  # CPU seconds spent spinning, all threads
    wakes: int  # times the threads were woken to spin


class KeepWarm:
    """One per process in effect (the threads are the process's): ``touch()``
    keeps ``threads`` CPUs busy at idle priority for ``window_s`` more.
    ``window_s`` 0 or ``threads`` 0: off, every call does nothing."""

    def __init__(self, threads: int, window_s: float = DEFAULT_WINDOW_S) -> None:
        if threads < 0 or window_s < 0:
            raise ValueError("keep-warm threads and window are not negative")
        self.window_ns = int(window_s * 1e9)
        self.on = threads > 0 and self.window_ns > 0
        self._lib = None
        if self.on:
            self._lib = _native()
            self._lib.meshnet_keepwarm_start(threads)

    def touch(self) -> None:
        """A step came or went: keep the CPUs awake for one window from now."""
        if self.on:
            lib = self._lib
            lib.meshnet_keepwarm_until(lib.meshnet_keepwarm_now_ns() + self.window_ns)

    def stop(self) -> None:
        """Stop spinning now (the threads sleep until the next ``touch``)."""
        if self.on:
            self._lib.meshnet_keepwarm_stop()

    def remaining_s(self) -> float:
        """How long the threads keep spinning from now (0: they sleep)."""
        if not self.on:
            return 0.0
        lib = self._lib
        return max(0, lib.meshnet_keepwarm_deadline_ns() - lib.meshnet_keepwarm_now_ns()) / 1e9

    def stats(self) -> KeepWarmStats:
        if not self.on:
            return KeepWarmStats(0, None, 0.0, 0)
        out = (ctypes.c_int64 * 4)()
        self._lib.meshnet_keepwarm_stats(out)
        return KeepWarmStats(int(out[0]), None if out[1] == 0 else out[1] > 0, out[2] / 1e9, int(out[3]))


OFF = KeepWarm(0, 0.0)
