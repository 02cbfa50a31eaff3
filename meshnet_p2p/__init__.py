"""meshnet-p2p: a peer-to-peer volunteer network that runs large language models
across many machines, one contiguous range of transformer layers per peer."""

__version__ = "0.1.0"
