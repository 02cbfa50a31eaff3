"""The shard engine: cutting GGUF models into layer shards and running them on
llama.cpp behind the :class:`~meshnet_p2p.engine.contract.ShardEngine` contract.
Knows nothing of networks, trio or gRPC."""
