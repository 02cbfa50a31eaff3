"""A certifier's catalogue: the model names it vouches for (issue 29, point 2).

One signed record per certifier, under ``names/<certifier peer ID>``, lists
entries ``{name, model_digest, manifest_digest, file_size}``: "the file whose
manifest has this digest is the model called this". Only the certifier can
sign for its key, so strangers can neither add a name to it nor crowd it out;
whose catalogues count is the reader's trust policy (the same certifiers whose
certificates it believes). A name is resolved over every trusted catalogue:
one digest, or a typed error naming what was found: none (a name nobody it
trusts certified) or several (two digests under one name are shown, never
chosen between).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import PayloadType, Record, sign_record

CATALOGUE = "meshnet/catalogue/v1"
CATALOGUE_TTL_MS = 24 * 3600 * 1000  # as certificates: a certifier renews it when it certifies again
MAX_ENTRIES = 64
MAX_NAME = 96
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # what a user types after --model
HEX64 = re.compile(r"[0-9a-f]{64}")  # a digest as text
MAX_FILE_SIZE = 1 << 50


class CatalogueError(MeshnetError):
    """A model name that resolves to no model, or to more than one."""


def catalogue_key(certifier: str) -> str:
    return f"names/{certifier}"


@dataclass(frozen=True)
class Entry:
    name: str
    model_digest: str
    manifest_digest: str
    file_size: int

    def to_content(self) -> dict[str, Any]:
        return {"name": self.name, "model_digest": self.model_digest, "manifest_digest": self.manifest_digest,
                "file_size": self.file_size}


def name_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or NAME.fullmatch(name) is None:
        return f"a model name is 1-{MAX_NAME} letters, digits and . _ + - (not starting with a sign)"
    return None


def _entry_problem(e: Any) -> str | None:
    if not isinstance(e, Mapping) or set(e) != {"name", "model_digest", "manifest_digest", "file_size"}:
        return "an entry is {name, model_digest, manifest_digest, file_size}"
    if (why := name_problem(e["name"])) is not None:
        return why
    if not all(isinstance(e[k], str) and HEX64.fullmatch(e[k]) for k in ("model_digest", "manifest_digest")):
        return "an entry's digests are sha256 hex"
    if type(e["file_size"]) is not int or not 0 < e["file_size"] <= MAX_FILE_SIZE:
        return "an entry's file_size is a positive integer"
    return None


def _valid(c: Mapping[str, Any]) -> str | None:
    """For the DHT: a node stores and gossips only a well-formed catalogue."""
    if not isinstance(c, Mapping) or set(c) != {"key", "certifier", "entries"}:
        return "a catalogue is {key, certifier, entries}"
    if not isinstance(c["certifier"], str) or c["key"] != catalogue_key(c["certifier"]):
        return "key must be names/<certifier>"
    entries = c["entries"]
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        return f"entries are a list of at most {MAX_ENTRIES}"
    for e in entries:
        if (why := _entry_problem(e)) is not None:
            return why
    pairs = [(e["name"], e["model_digest"]) for e in entries]
    if len(set(pairs)) != len(pairs):
        return "an entry is listed twice"
    return None


CATALOGUE_TYPE = PayloadType(CATALOGUE, max_payload_bytes=16 * 1024, claimed_peer_field="certifier",
                             replay_key_field="key", validate=_valid)
TYPES = {CATALOGUE: CATALOGUE_TYPE}


def entries_of(record: Record) -> list[Entry]:
    return [Entry(e["name"], e["model_digest"], e["manifest_digest"], e["file_size"]) for e in record.content["entries"]]


def with_entry(before: Sequence[Entry], new: Entry) -> list[Entry]:
    """A certifier's entries with ``new`` first: the same name and model replaced, the
    oldest dropped past MAX_ENTRIES."""
    if (why := name_problem(new.name)) is not None:
        raise CatalogueError(why)
    kept = [e for e in before if (e.name, e.model_digest) != (new.name, new.model_digest)]
    return [new, *kept][:MAX_ENTRIES]


def sign_catalogue(identity: Identity, entries: Sequence[Entry], *, now_ms: int, ttl_ms: int = CATALOGUE_TTL_MS) -> bytes:
    me = str(identity.peer_id)
    content = {"key": catalogue_key(me), "certifier": me, "entries": [e.to_content() for e in entries]}
    if (why := _valid(content)) is not None:
        raise CatalogueError(why)
    return sign_record(identity, CATALOGUE, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


@dataclass(frozen=True)
class Named:
    """A name as the trusted catalogues give it: each (model, manifest) and who vouches for it."""

    entry: Entry
    certifiers: tuple[str, ...]


def names(records: Iterable[Record], trusted: Iterable[str]) -> dict[str, list[Named]]:
    """Every name in the trusted certifiers' catalogues (each certifier's newest),
    with every distinct (model digest, manifest digest) it was given."""
    trusted = set(trusted)
    newest: dict[str, Record] = {}
    for r in records:
        who = r.content.get("certifier")
        if r.payload_type == CATALOGUE and who in trusted and (who not in newest or r.seq > newest[who].seq):
            newest[who] = r
    found: dict[tuple, list[str]] = {}
    for who, r in sorted(newest.items()):
        for e in entries_of(r):
            found.setdefault((e.name, e.model_digest, e.manifest_digest, e.file_size), []).append(who)
    out: dict[str, list[Named]] = {}
    for (name, model, manifest, size), who in sorted(found.items()):
        out.setdefault(name, []).append(Named(Entry(name, model, manifest, size), tuple(who)))
    return out


def resolve(name: str, records: Iterable[Record], trusted: Iterable[str]) -> Named:
    """The one model ``name`` names in the trusted catalogues; CatalogueError if none or several."""
    if (why := name_problem(name)) is not None:
        raise CatalogueError(why)
    trusted = list(trusted)
    found = names(records, trusted).get(name, [])
    if not found:
        raise CatalogueError(f"no certifier this client trusts names a model {name!r} "
                             f"({len(trusted)} trusted; `meshnet-peer status` lists the names they certified)")
    if len(found) > 1:
        shown = "; ".join(f"model {n.entry.model_digest[:12]} (manifest {n.entry.manifest_digest[:12]}) "
                          f"by {', '.join(c[-8:] for c in n.certifiers)}" for n in found)
        raise CatalogueError(f"the name {name!r} is given to {len(found)} different files: {shown}; "
                             f"name one by its model digest")
    return found[0]
