"""The root of the project's typed errors.

Every error a user or a peer can cause derives from :class:`MeshnetError`, so the
CLI can print it as one clear line and a server can map it to a status code.
"""


class MeshnetError(Exception):
    """Base class of every expected, user- or peer-caused failure."""
