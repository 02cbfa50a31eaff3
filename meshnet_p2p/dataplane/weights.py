"""The WeightStore service (proto/weights.proto): parts of the model files this
peer holds, for volunteers that fetch only their span (docs/weights.md); and
:class:`WeightClient`, the typed client of a peer's WeightStore.

A peer serves a model file it holds whole (``join --model PATH``) or the parts
of one it fetched (engine/partial.py), by the file's manifest: its header and
its tensors, each in 1 MiB chunks. Nothing here is trusted by the fetcher,
which checks every part against the manifest; what this side guards is its
own capacity, so that serving weights never starves inference:

- parts are sent from background threads (transport/server.py): the lowest CPU
  priority, so under contention the OS runs the engine's and the sessions'
  threads first, and no worker a session needs is held by a download;
- all downloads together at most ``rate_bytes_s`` (a token bucket the sending
  threads wait on: a download is slowed, not refused);
- at most ``max_downloads`` at once, ``per_source_downloads`` of them from one
  source (its host group), and ``requests_per_s`` part requests a source
  (burst twice that): past these, RESOURCE_EXHAUSTED, the request's refusal;
- a part the manifest does not list, or a range outside it: INVALID_ARGUMENT;
  a manifest or a part this peer does not hold: NOT_FOUND.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from meshnet_p2p._proto import weights_pb2 as pb
from meshnet_p2p.core.ratelimit import SourceRates, TokenBucket
from meshnet_p2p.engine.manifest import Manifest, ManifestError
from meshnet_p2p.engine.partial import HEADER
from meshnet_p2p.dataplane.transport import grpc_core
from meshnet_p2p.dataplane.transport.channel import Channel
from meshnet_p2p.dataplane.transport.server import SERVER_STREAM, UNARY, Abort, Caller, Method, Server

SERVICE = "meshnet.weights.v1.WeightStore"
CHUNK = 1 << 20
MAX_DIGEST_CHARS = 64
MAX_PART_CHARS = 256


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


@dataclass(frozen=True)
class WeightLimits:
    rate_bytes_s: float = 32 << 20  # every download together (~250 Mbit/s)
    max_downloads: int = 4
    per_source_downloads: int = 2
    # part requests one source may make (a burst of twice that): a span of a big model has a hundred tiny
    # tensors (norms), each a request; bytes are what the rate above bounds
    requests_per_s: float = 64.0


@dataclass
class _Held:
    manifest: Manifest
    path: str  # the file, whole or sparse (engine/partial.py), in the manifest's layout
    parts: Callable[[], set[str]] | None  # the parts there now; None: every part (a whole file)


class WeightStore:
    def __init__(self, limits: WeightLimits = WeightLimits(), *, clock=time.monotonic, sleep=time.sleep) -> None:
        self.limits = limits
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._bucket = TokenBucket(4 * CHUNK, limits.rate_bytes_s, clock())
        self._requests = SourceRates(burst=2 * limits.requests_per_s, rate_per_s=limits.requests_per_s)
        self._running: dict[str, int] = {}  # downloads at once, per source
        self.bytes_served = 0
        self.refused = 0

    def add(self, manifest: Manifest, path: str, parts: Callable[[], set[str]] | None = None) -> str:
        """Serve the file at ``path`` by ``manifest``; ``parts``: which are there (None: all). Its digest."""
        digest = manifest.digest()
        with self._lock:
            self._held[digest] = _Held(manifest, path, parts)
        return digest

    def methods(self) -> dict[str, Method]:
        def get_manifest(raw: bytes, caller: Caller) -> bytes:
            return self.get_manifest(_decoded(pb.ManifestRequest, raw), caller).SerializeToString()

        def get_part(raw: bytes, caller: Caller) -> Iterator[bytes]:
            for data in self.get_part(_decoded(pb.PartRequest, raw), caller):
                yield pb.PartChunk(data=data).SerializeToString()

        return {method_path("GetManifest"): Method(UNARY, get_manifest),
                # below inference: its own threads at the lowest CPU priority, no session's worker
                method_path("GetPart"): Method(SERVER_STREAM, get_part, background=True)}

    def register(self, server: Server) -> Server:
        return server.register(self.methods())

    # --- the methods, on decoded requests ------------------------------------------

    def get_manifest(self, req: pb.ManifestRequest, caller: Caller) -> pb.ManifestReply:
        held = self._find(req.manifest_digest)
        whole = held.parts is None
        parts = [] if whole else sorted(held.parts())
        return pb.ManifestReply(manifest=held.manifest.to_bytes(), whole=whole, parts=parts)

    def get_part(self, req: pb.PartRequest, caller: Caller) -> Iterator[bytes]:
        held = self._find(req.manifest_digest)
        m = held.manifest
        if len(req.part) > MAX_PART_CHARS:
            raise self._refuse(grpc_core.INVALID_ARGUMENT, "a part's name is at most 256 characters")
        if req.part == HEADER:
            lo, hi = 0, m.header_size
        else:
            try:
                lo, hi = m.span(m.tensor(req.part))
            except ManifestError as e:
                raise self._refuse(grpc_core.INVALID_ARGUMENT, str(e)) from None
        size = hi - lo
        length = size - req.offset if req.length == 0 else req.length
        if req.offset > size or length <= 0 or req.offset + length > size:
            raise self._refuse(grpc_core.INVALID_ARGUMENT,
                               f"bytes {req.offset}+{req.length} are outside part {req.part!r} ({size} bytes)")
        if held.parts is not None and req.part not in held.parts():
            raise self._refuse(grpc_core.NOT_FOUND, f"this peer does not hold part {req.part!r}")
        source = caller.host_group
        self._admit(source)
        try:
            yield from self._send(held.path, lo + req.offset, length)
        finally:
            with self._lock:
                self._running[source] -= 1
                if not self._running[source]:
                    del self._running[source]

    # --- inside --------------------------------------------------------------------

    def _find(self, digest: str) -> _Held:
        with self._lock:
            held = self._held.get(digest) if len(digest) <= MAX_DIGEST_CHARS else None
        if held is None:
            raise self._refuse(grpc_core.NOT_FOUND, f"this peer holds no model file with manifest {digest[:64]!r}")
        return held

    def _refuse(self, status: int, message: str) -> Abort:
        with self._lock:
            self.refused += 1
        return Abort(status, message)

    def _admit(self, source: str) -> None:
        lim = self.limits
        with self._lock:
            if not self._requests.allow(source, int(self._clock() * 1000)):
                self.refused += 1
                raise Abort(grpc_core.RESOURCE_EXHAUSTED, f"more than {lim.requests_per_s:g} part requests a second")
            if sum(self._running.values()) >= lim.max_downloads:
                self.refused += 1
                raise Abort(grpc_core.RESOURCE_EXHAUSTED, f"{lim.max_downloads} downloads are running here; ask another peer or later")
            if self._running.get(source, 0) >= lim.per_source_downloads:
                self.refused += 1
                raise Abort(grpc_core.RESOURCE_EXHAUSTED, f"{lim.per_source_downloads} downloads from one source at once")
            self._running[source] = self._running.get(source, 0) + 1

    def _send(self, path: str, offset: int, length: int) -> Iterator[bytes]:
        with open(path, "rb") as f:
            f.seek(offset)
            while length:
                n = min(CHUNK, length)
                self._wait_for(n)
                data = f.read(n)
                if len(data) != n:  # the file shrank under us: the call ends, the peer serves on
                    raise Abort(grpc_core.INTERNAL, "the model file ended early")
                with self._lock:
                    self.bytes_served += n
                length -= n
                yield data

    def _wait_for(self, n: int) -> None:
        """Block this download's thread until the shared bucket has ``n`` bytes for it."""
        while True:
            with self._lock:
                wait = self._bucket.take(self._clock(), n)
            if wait <= 0:
                return
            self._sleep(wait)


class WeightClient:
    """Calls to one peer's WeightStore over a channel (a pool's lease or a channel of its own)."""

    def __init__(self, channel: Channel, *, timeout: float = 120.0) -> None:
        self.channel = channel
        self.timeout = timeout

    def manifest(self, digest: str) -> tuple[Manifest, bool, frozenset[str]]:
        """The manifest of that digest (checked against it), whether this peer holds the
        whole file, and else which parts it holds."""
        raw = self.channel.unary(method_path("GetManifest"), pb.ManifestRequest(manifest_digest=digest)
                                 .SerializeToString(), timeout=self.timeout)
        try:
            reply = pb.ManifestReply.FromString(raw)
            m = Manifest.from_bytes(reply.manifest)
        except ManifestError:
            raise
        except Exception as e:
            raise ManifestError(f"a peer's manifest reply is malformed: {e}") from None
        if m.digest() != digest:
            raise ManifestError(f"a peer answered manifest {digest[:12]} with another ({m.digest()[:12]})")
        return m, reply.whole, frozenset(reply.parts)

    def part(self, digest: str, part: str, size: int, *, stop: Callable[[], bool] = lambda: False) -> bytes | None:
        """The ``size`` bytes of one part (the caller knows its size from the manifest:
        a peer that sends more is cut off, not believed); None if ``stop()`` turned true
        between chunks (another source gave the part first: the call is cancelled)."""
        deadline = time.monotonic() + self.timeout
        stream = self.channel.stream(method_path("GetPart"), timeout=self.timeout, with_first_message=True)
        try:
            stream.send(pb.PartRequest(manifest_digest=digest, part=part).SerializeToString(), end=True)
            out = bytearray()
            while (raw := stream.recv(deadline=deadline)) is not None:
                try:
                    out += pb.PartChunk.FromString(raw).data
                except Exception as e:
                    raise ManifestError(f"a peer's part chunk is malformed: {e}") from None
                if len(out) > size:
                    raise ManifestError(f"a peer sent more than the {size} bytes of part {part!r}")
                if stop():
                    return None
            return bytes(out)
        finally:
            stream.cancel()


def _decoded(kind, raw: bytes):
    try:
        return kind.FromString(raw)
    except Exception as e:  # protobuf's DecodeError and friends: the call ends, nothing else does
        raise Abort(grpc_core.INVALID_ARGUMENT, f"malformed request: {e}") from None
