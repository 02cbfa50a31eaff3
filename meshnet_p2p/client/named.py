"""A model this machine does not hold: its name resolved through the trusted
certifiers' catalogues, its manifest and only the parts it needs fetched from
the peers that serve it (docs/weights.md).

``join --model NAME|DIGEST`` on a machine with no model file fetches its
span's parts (:func:`obtain`): a partial model in the cache (engine/partial.py)
that shards are cut from exactly as from the whole file, and whose parts this
peer then serves to the next volunteer. A client by name fetches only the
header (:func:`open_named`): the metadata and vocabulary a tokenizer needs,
checked against the manifest, in a sparse file of the model's size that
llama.cpp loads vocab-only (it reads no tensor, and the holes are never read).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import trio

from meshnet_p2p.client.fetch import fetch_parts
from meshnet_p2p.route.hop import connect
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.dataplane.transport.channel import ChannelError
from meshnet_p2p.dataplane.weights import WeightClient
from meshnet_p2p.engine.manifest import Manifest, ManifestError
from meshnet_p2p.engine.models import cache_dir
from meshnet_p2p.engine.partial import HEADER, PartialModel
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.node import peers_for_model, start_node
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.swarm.view import newest_signed_by
from meshnet_p2p.trust.catalogue import HEX64, CatalogueError, Named, catalogue_key, names, resolve
from meshnet_p2p.trust.policy import TrustPolicy

CALL_TIMEOUT_S = 120.0


class ModelUnavailable(MeshnetError):
    """No peer could give the manifest or a needed part of the model asked for."""


async def find_model(node, ref: str, trust: TrustPolicy) -> Named:
    """What ``ref`` (a name, or a model digest) names in the trusted certifiers' catalogues."""
    records = [r for c in sorted(trust.certifiers)
               if (r := await newest_signed_by(node, catalogue_key(c), c)) is not None]
    if HEX64.fullmatch(ref):
        found = [n for named in names(records, trust.certifiers).values() for n in named if n.entry.model_digest == ref]
        if len({n.entry.manifest_digest for n in found}) != 1:
            raise CatalogueError(f"model {ref[:12]} is in no trusted certifier's catalogue" if not found else
                                 f"model {ref[:12]} is listed with {len(found)} different manifests")
        return found[0]
    return resolve(ref, records, trust.certifiers)


async def model_sources(node, named: Named, log: Callable[[str], None]
                   ) -> tuple[Manifest, list[Span], dict[str, WeightClient], dict[str, frozenset[str] | None]]:
    """The manifest the catalogue names, from the peers serving the model, and what each holds."""
    digest, model = named.entry.manifest_digest, named.entry.model_digest
    reports = await peers_for_model(node, model)
    spans = [Span.from_report(r) for r in reports if r.content.get("departing") is not True]
    sources: dict[str, WeightClient] = {}
    holdings: dict[str, frozenset[str] | None] = {}
    manifest: Manifest | None = None
    for s in spans:  # ask every serving peer what it holds (a few small calls)
        client = WeightClient(connect(s, CALL_TIMEOUT_S).channel, timeout=CALL_TIMEOUT_S)
        try:
            m, whole, parts = await trio.to_thread.run_sync(client.manifest, digest)
            if m.model_digest != model:  # the manifest is the digest's (checked); its model must be the name's
                raise ManifestError(f"manifest {digest[:12]} is of model {m.model_digest[:12]}, not {model[:12]}")
        except (ChannelError, ManifestError, MeshnetError) as e:
            log(f"peer {s.peer_id[-8:]} gives no parts: {e}")
            client.channel.close()
            continue
        manifest = manifest or m
        sources[s.peer_id] = client
        holdings[s.peer_id] = None if whole else parts
    if manifest is None:
        raise ModelUnavailable(f"no peer serving model {model[:12]} gives its manifest {digest[:12]} "
                               f"({len(spans)} asked)")
    return manifest, spans, sources, holdings


async def obtain(node, named: Named, choose: Callable[[list[Span], int], Awaitable[tuple[int, int]]],
                 log: Callable[[str], None], progress=None) -> tuple[PartialModel, int, int, dict]:
    """The manifest, the span ``choose`` picks (from the peers' spans and the layer count)
    and that span's parts, from the peers serving the model; returns the partial model,
    the span and what the fetch did."""
    manifest, spans, sources, holdings = await model_sources(node, named, log)
    partial = PartialModel(os.path.join(cache_dir(), "models"), manifest)
    report: dict = {"bytes": 0, "set_aside": {}}
    try:
        if partial.header is None:
            r = await trio.to_thread.run_sync(lambda: fetch_parts(partial, [HEADER], sources, holdings))
            report["bytes"] += r.bytes
        start, end = await choose(spans, manifest.n_layer)
        missing = partial.missing(start, end)
        need = sum(t.nbytes for t in partial.needed(start, end))
        log(f"fetching layers {start}:{end} of {named.entry.name}: {len(missing)} parts, "
            f"{sum(t.nbytes for t in missing)} bytes ({need} for the span, of {manifest.file_size} in the file) "
            f"from {len(sources)} peers")
        wanted = [t.name for t in missing]
        r = await trio.to_thread.run_sync(lambda: fetch_parts(partial, wanted, sources, holdings, progress=progress))
        report["bytes"] += r.bytes
        report["set_aside"] = r.set_aside
        for who, why in r.set_aside.items():
            log(f"set peer {who[-8:]} aside: {why}")
    finally:
        for c in sources.values():
            c.channel.close()
    return partial, start, end, report


async def fetch_header(node, named: Named, log: Callable[[str], None]) -> PartialModel:
    """The model's header (metadata, vocabulary, tensor table) in its partial copy here."""
    manifest, _, sources, holdings = await model_sources(node, named, log)
    partial = PartialModel(os.path.join(cache_dir(), "models"), manifest)
    try:
        if partial.header is None:
            await trio.to_thread.run_sync(lambda: fetch_parts(partial, [HEADER], sources, holdings))
    finally:
        for c in sources.values():
            c.channel.close()
    return partial


@dataclass(frozen=True)
class NamedModel:
    """What a client by name needs: a file to load the vocabulary from, and the model's identity."""

    path: str  # the partial copy: its header, holes elsewhere
    model_digest: str
    n_layer: int
    name: str
    certifiers: tuple[str, ...]  # whose catalogues name it


def open_named(bootstrap: Sequence[Any], ref: str, trust: TrustPolicy,
               log: Callable[[str], None] = lambda _: None) -> NamedModel:
    """Resolve ``ref`` (a name or model digest) and fetch the model's header, through a
    client-mode DHT node joined at ``bootstrap``; typed errors (CatalogueError: no such
    name, or two; ModelUnavailable: no peer gives it)."""

    async def run() -> NamedModel:
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            named = await find_model(node, ref, trust)
            partial = await fetch_header(node, named, log)
            nursery.cancel_scope.cancel()
        m = partial.manifest
        return NamedModel(partial.path, m.model_digest, m.n_layer, named.entry.name, named.certifiers)

    return trio.run(run)
