"""The shard engine: cutting GGUF models into layer shards and running them on
llama.cpp behind the :class:`~meshnet_p2p.engine.contract.ShardEngine` contract.
Knows nothing of networks, trio or gRPC. Also: where the embedded model
package is (models).

May import: core.
"""

import os as _os

# llama.cpp's CPU backend is built with OpenMP here, and libgomp reads this when
# llama_cpp loads it, so it must be set before any submodule imports llama_cpp.
# After a step, idle OpenMP workers spin for GOMP_SPINCOUNT iterations (300,000
# by default) before sleeping. A peer's next step comes a network round trip
# later, and meanwhile the next peer of the route, often on the same machine in
# tests and demos, needs those cores: bench/e2e.py went from 51 to 62 tokens/s
# with 10,000, and from 85 to 88 with 1,000 (A/B, four pairs), while a whole
# model in one process kept its speed. Far less (100) starves llama.cpp's own
# parallel regions. The operator's own setting wins.
_os.environ.setdefault("GOMP_SPINCOUNT", "1000")
