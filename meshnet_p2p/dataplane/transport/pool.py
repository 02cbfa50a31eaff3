"""Channels shared between sessions: one connection to a peer carries many calls.

A client serving many users, and a peer linking many rings to the same next
hop, would otherwise open one TLS connection per session, and run into the
per-source connection cap of the peer they reach (server.py: 16 from one
address), which is there against floods. A lease hands out a channel to the
peer with room for another call; when its users are gone, an idle channel is
kept for the next lease, but not once it has been idle long enough that the
peer may be closing it (its idle timeout is 60 s), nor once it is broken.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from .channel import Channel

CALLS_PER_CHANNEL = 16  # sessions one channel carries before a second is opened (a server allows 32 calls)
REUSE_IDLE_S = 20.0  # an idle channel older than this is closed rather than reused (the peer's idle timeout is 60 s)
MAX_IDLE_CHANNELS = 64  # idle channels kept in all; the oldest are closed beyond this


@dataclass(eq=False)
class _Entry:
    channel: Channel
    users: int = 0
    idle_since: float = field(default_factory=time.monotonic)


def _usable(ch: Channel) -> bool:
    wire = ch.wire
    return ch.broken is None and (wire is None or (wire.goaway is None and not wire.closed))


def _fresh(ch: Channel) -> bool:
    """Whether an idle channel still serves, after reading what already came on it
    (nobody reads an idle channel: a GOAWAY or the peer's FIN may be waiting)."""
    if ch.wire is not None and ch.broken is None:
        try:
            ch.read_once(0, unless_waiters=True)
        except Exception:  # the read breaks the channel, saying why; it is simply not reused
            pass
    return _usable(ch)


class ChannelPool:
    def __init__(self, *, per_channel: int = CALLS_PER_CHANNEL, reuse_idle_s: float = REUSE_IDLE_S,
                 max_idle: int = MAX_IDLE_CHANNELS) -> None:
        self.per_channel = per_channel
        self.reuse_idle_s = reuse_idle_s
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._entries: dict[Hashable, list[_Entry]] = {}
        self._closed = False

    def lease(self, key: Hashable, make: Callable[[], Channel]) -> tuple[Channel, Callable[[], None]]:
        """A channel for ``key`` (how a peer is reached, and as whom) and the
        function that gives it back (call it once, when the call or session ends)."""
        doomed: list[Channel] = []
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the channel pool is closed")
                doomed = self._sweep_locked(time.monotonic())
                for e in self._entries.get(key, ()):
                    if e.users < self.per_channel and (_fresh(e.channel) if e.users == 0 else _usable(e.channel)):
                        e.users += 1
                        return e.channel, self._releaser(key, e)
                e = _Entry(make(), users=1)  # opening a channel does no I/O: it connects on first use
                self._entries.setdefault(key, []).append(e)
                return e.channel, self._releaser(key, e)
        finally:
            for ch in doomed:
                ch.close()

    def _releaser(self, key: Hashable, e: _Entry) -> Callable[[], None]:
        done = []

        def release() -> None:
            close = False
            with self._lock:  # once, whoever calls it how often from where
                if done:
                    return
                done.append(True)
                e.users -= 1
                if e.users == 0:
                    e.idle_since = time.monotonic()
                    if self._closed or not _usable(e.channel):
                        self._drop_locked(key, e)
                        close = True
            if close:
                e.channel.close()
        return release

    def _drop_locked(self, key: Hashable, e: _Entry) -> None:
        entries = self._entries.get(key, [])
        if e in entries:
            entries.remove(e)
        if not entries:
            self._entries.pop(key, None)

    def _sweep_locked(self, now: float) -> list[Channel]:
        """Idle channels that are broken, too old to reuse, or beyond the idle cap: out."""
        idle = [(e.idle_since, key, e) for key, es in self._entries.items() for e in es if e.users == 0]
        idle.sort(key=lambda t: t[0])
        out = []
        keep = self.max_idle
        for i, (since, key, e) in enumerate(idle):
            if not _usable(e.channel) or now - since > self.reuse_idle_s or len(idle) - i > keep:
                self._drop_locked(key, e)
                out.append(e.channel)
        return out

    def close(self) -> None:
        """Close every channel now (leases still out end UNAVAILABLE)."""
        with self._lock:
            self._closed = True
            channels = [e.channel for es in self._entries.values() for e in es]
            self._entries.clear()
        for ch in channels:
            ch.close()
