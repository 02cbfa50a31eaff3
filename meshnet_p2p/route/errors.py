"""What a route's failures mean: the client's errors, and which peer errors
are the request's or a busy peer's (no ban) rather than the peer's fault."""

from __future__ import annotations

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.dataplane.stub import ShardConnectionError, ShardError


class GenerationError(MeshnetError):
    pass


class ClientClosed(GenerationError):
    """The client was closed: work of it still under way (an audit, a re-check)
    stops at its next look at the swarm."""


class RequestRefused(MeshnetError):
    """Every peer that could serve refused the request itself (it asks for more
    than they hold, or is malformed): the request's error, no peer's fault."""


def refuses_the_request(e: MeshnetError) -> bool:
    """A refusal caused by what was asked, not by the peer: no reason to ban it."""
    return isinstance(e, ShardError) and not e.retryable and e.code_name in (
        "CAPACITY", "INVALID_ARGUMENT", "CONTEXT_EXHAUSTED")


def is_full(e: Exception) -> bool:
    """The peer has no session to spare now (or took one back to share fairly), or
    turned the call away before any work (its per-connection or per-source
    limits, or its bound on ring links for this client): not its fault."""
    return (isinstance(e, ShardError) and e.code_name in ("CAPACITY", "LINK_LIMITED") and e.retryable) or \
        (isinstance(e, ShardConnectionError) and e.refused)
