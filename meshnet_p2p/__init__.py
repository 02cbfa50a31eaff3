"""meshnet-p2p: a peer-to-peer volunteer network that runs large language models
across many machines, one contiguous range of transformer layers per peer.

``meshnet_p2p.Client`` is the client API (see :mod:`meshnet_p2p.client.api`); it is
imported on first use, so ``import meshnet_p2p`` stays light.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Client":
        from meshnet_p2p.client import Client

        return Client
    raise AttributeError(f"module 'meshnet_p2p' has no attribute {name!r}")
