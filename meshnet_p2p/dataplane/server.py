"""Serving a shard over gRPC with identity-bound TLS, started and stopped from trio.

grpcio runs its own thread pool; this module is the one place it meets trio:
start is immediate, stop (which blocks on in-flight RPCs) runs in a worker
thread so the trio loop never blocks, and nothing is left running after.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import trio

from .._proto import shard_runtime_pb2_grpc as pb_grpc
from .servicer import ShardRuntimeServicer
from .tls import TlsCredentials

# Both ends: the servicer bounds messages itself (typed OVERSIZED errors), so
# grpcio's own limit only guards against the absurd.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.optimization_target", "latency"),
]
GRPC_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]  # port 0 must mean a port of our own


class ShardServer:
    def __init__(self, servicer: ShardRuntimeServicer, creds: TlsCredentials, *, host: str = "127.0.0.1",
                 port: int = 0, max_workers: int = 32) -> None:
        self.servicer = servicer
        # Each open stream holds two pool threads (handler + request reader).
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard-rpc")
        self._server = grpc.server(self._executor, options=GRPC_OPTIONS)
        pb_grpc.add_ShardRuntimeServicer_to_server(servicer, self._server)
        credentials = grpc.ssl_server_credentials([(creds.key_pem, creds.cert_pem)])
        self.port = self._server.add_secure_port(f"{host}:{port}", credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.host = host

    def start(self) -> "ShardServer":
        self._server.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting, cancel what is still running after ``grace`` seconds
        (each stream's handler then releases its session), and join the threads."""
        self._server.stop(grace).wait()
        self._executor.shutdown(wait=True)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (from a trio nursery)."""
        self.start()
        try:
            task_status.started(self)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.stop, 1.0)
