"""The root of the project's typed errors.

Every error a user or a peer can cause derives from :class:`MeshnetError`, so the
CLI can print it as one clear line and a server can map it to a status code.
"""


class MeshnetError(Exception):
    """Base class of every expected, user- or peer-caused failure."""


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


class unwrap_errors:
    """Re-raise a trio nursery's exception group as its single expected error.

    trio wraps whatever escapes a nursery in an exception group; when every
    leaf is a :class:`MeshnetError` (a refused bootstrap, no route...), callers
    want that error, not the group. Anything else propagates unchanged."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds or (MeshnetError,)

    def __enter__(self) -> "unwrap_errors":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, BaseExceptionGroup):
            leaves = list(_leaves(exc))
            if leaves and all(isinstance(e, self.kinds) for e in leaves):
                raise leaves[0] from None
        return False


def sanitize(text: object, limit: int = 500) -> str:
    """Text from the network made safe for a terminal or a log: control and other
    non-printable characters escaped, length bounded."""
    s = str(text)[:limit]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
