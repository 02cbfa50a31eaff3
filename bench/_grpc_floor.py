"""The floor under bench/hop.py: the same shard behind a bare grpcio stream.

    python bench/_grpc_floor.py SHARD THREADS MAX_TOKENS

One bidirectional stream method over the same identity-bound TLS, whose
messages are raw float32 hidden-state bytes (no protobuf, no tensor bundle,
no CRC, no session protocol) and whose handler calls the engine directly.
What a hop costs over this, against the engine in-process, is what grpcio
itself costs on this machine; what ``meshnet-peer serve`` costs beyond it is
ours. Prints its port and its certificate (hex), then serves until stdin closes.
"""

from __future__ import annotations

import sys
from concurrent import futures

import grpc

from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, LoadRequest, OpenRequest, Tensor, TensorBundle
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.core.identity import Identity

SERVICE, METHOD = "floor.Hop", "Step"
GRPC_OPTIONS = [("grpc.so_reuseport", 0)]  # port 0 must mean a port of our own


def same(b: bytes) -> bytes:
    return b  # raw bytes both ways: no serializer


def main() -> int:
    shard, threads, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = LlamaCppShardEngine()
    engine.load(LoadRequest(shard, max_sessions=1, n_ctx_per_session=max_tokens, n_threads=threads)).status.raise_for_status()
    n_embd = engine.capabilities().n_embd
    engine.open_session(OpenRequest("floor", max_tokens)).raise_for_status()

    def step(requests, context):
        for pos, raw in enumerate(requests):
            bundle = TensorBundle((Tensor(HIDDEN, "f32", (1, n_embd), raw),))
            yield engine.decode(DecodeRequest("floor", pos, hidden=bundle)).hidden.tensors[0].data

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(step, same, same)}),))
    creds = make_tls_credentials(Identity.generate())
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(creds.key_pem, creds.cert_pem)]))
    server.start()
    print(port, flush=True)
    print(creds.cert_pem.hex(), flush=True)
    sys.stdin.read()
    server.stop(None)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
