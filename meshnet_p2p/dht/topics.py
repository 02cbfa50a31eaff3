"""Which gossip topics a node follows, and which peers follow them, as pure data.

A node that does not follow every topic (``DHTConfig.follow_all``) follows the
keys it publishes, reads or subscribes to (:meth:`Follows.follow`), at most
``max_followed`` of them, the least recently used forgotten: what a node holds
and pulls grows with the models it serves or uses, not with the swarm. It pulls
them one at a time, in turn (:meth:`Follows.next_pull`). Peers that pulled a
topic alone from us follow it (:meth:`Follows.heard`); the latest
``max_followers`` of each are kept, as push targets for its news. What the
node last found of a followed topic's signers is kept with it too
(:meth:`Follows.signers`), and forgotten with it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

MAX_FOLLOWED = 64
MAX_FOLLOWERS = 32


class Follows:
    def __init__(self, follow_all: bool, *, max_followed: int = MAX_FOLLOWED,
                 max_followers: int = MAX_FOLLOWERS) -> None:
        self.follow_all = follow_all
        self.max_followed = max_followed
        self.max_followers = max_followers
        self._followed: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._followers: OrderedDict[str, OrderedDict[Hashable, None]] = OrderedDict()  # topic -> peers
        self._signers: dict[str, tuple[float, dict]] = {}  # followed topic -> (when found, its signers found)
        self._turn = 0

    def __contains__(self, topic: str) -> bool:
        return self.follow_all or topic in self._followed

    def follow(self, topic: str) -> list[str]:
        """Follow ``topic`` (again: it becomes the most recently used). Returns the
        topics forgotten to stay within the bound: the caller drops what it held."""
        if self.follow_all:
            return []
        if topic in self._followed:
            self._followed.move_to_end(topic)
            return []
        self._followed[topic] = None
        gone = []
        while len(self._followed) > self.max_followed:
            old, _ = self._followed.popitem(last=False)
            self._followers.pop(old, None)
            self._signers.pop(old, None)
            gone.append(old)
        return gone

    def next_pull(self) -> str | None:
        """The followed topic the next pull asks about (each in turn), or None."""
        if not self._followed:
            return None
        topics = list(self._followed)
        topic = topics[self._turn % len(topics)]
        self._turn += 1
        return topic

    def heard(self, topic: str, peer: Hashable) -> None:
        """``peer`` pulled ``topic`` alone from us: it follows it. (The caller asks
        only for topics it holds any of; a bounded number of topics is kept.)"""
        followers = self._followers.get(topic)
        if followers is None:
            if len(self._followers) >= self.max_followed * 4:
                self._followers.popitem(last=False)
            followers = self._followers[topic] = OrderedDict()
        followers[peer] = None
        followers.move_to_end(peer)
        while len(followers) > self.max_followers:
            followers.popitem(last=False)

    def followers(self, topic: str) -> list[Hashable]:
        return list(self._followers.get(topic, ()))

    def signers(self, topic: str, now: float, max_age: float) -> list | None:
        """What :meth:`found_signers` kept for ``topic`` within ``max_age`` of ``now``,
        with what :meth:`signed` added since, or None."""
        kept = self._signers.get(topic)
        return list(kept[1]) if kept is not None and now - kept[0] < max_age else None

    def found_signers(self, topic: str, now: float, signers: list) -> None:
        """Keep what the caller found of a followed topic's signers (forgotten with the topic)."""
        if topic in self._followed:
            self._signers[topic] = (now, dict.fromkeys(signers))

    def signed(self, topic: str, signer: Hashable) -> None:
        """A record of ``signer`` came in on ``topic``: it is one of the signers kept,
        until they are found again (a newcomer is a push target at once)."""
        kept = self._signers.get(topic)
        if kept is not None:
            kept[1][signer] = None
