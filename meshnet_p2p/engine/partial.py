"""A partial copy of a model file: the parts fetched so far, each checked against
the model's manifest, at their own offsets in a sparse file of the model's size.

A shard is cut from it by the same code that cuts one from the whole file
(cut.cut_shard), which reads the header and the span's tensors and nothing
else (cut.tensors_needed), so a shard of fetched parts is byte-identical to
one cut from the whole file. Holes read as zeros; a cut refuses to run while
any tensor it needs is missing.

What is present is journaled (one JSON line per part, appended only after the
part's bytes are synced), so a fetch killed at any point resumes with what it
had; on opening, every journaled part is hashed again, and one whose bytes no
longer match (a disk error, an edit) is dropped and fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

from .cut import ShardCutError, ShardInfo, cut_shard, tensors_needed
from .gguf import GGUFFile, GGUFFormatError, read_gguf, read_range
from .manifest import Manifest, ManifestError, TensorEntry

HEADER = "\0header"  # the header's journal entry (no tensor name starts with NUL)


class MissingParts(ShardCutError):
    """A shard cannot be cut yet: parts it needs have not been fetched."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"{len(names)} parts are not fetched yet: {shown}")


class PartialModel:
    """The model file ``manifest`` describes, as far as it has been fetched, under ``root``."""

    def __init__(self, root: str, manifest: Manifest) -> None:
        self.manifest = manifest
        self.dir = os.path.join(root, manifest.source_sha256[:16])
        self.path = os.path.join(self.dir, manifest.file_name)
        self._journal = self.path + ".parts"
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != manifest.file_size:
                os.ftruncate(fd, manifest.file_size)  # sparse: holes cost no disk
        finally:
            os.close(fd)
        self.present: set[str] = set()
        self._header: GGUFFile | None = None
        self._recover()

    # --- what is here ---------------------------------------------------------

    @property
    def header(self) -> GGUFFile | None:
        """The parsed header, once it is here."""
        return self._header

    def needed(self, start: int, end: int) -> tuple[TensorEntry, ...]:
        """The tensors a shard of layers [start, end) is cut from (the header must be here)."""
        if self._header is None:
            raise MissingParts([HEADER])
        return tuple(self.manifest.tensor(t.name) for t in tensors_needed(self._header, start, end))

    def missing(self, start: int, end: int) -> tuple[TensorEntry, ...]:
        return tuple(t for t in self.needed(start, end) if t.name not in self.present)

    # --- adding parts ---------------------------------------------------------

    def put_header(self, data: bytes) -> GGUFFile:
        """Check and store the header; ManifestError (and nothing written) if it is not the file's."""
        src = self.manifest.check_header(data)
        self._write(0, data, HEADER)
        self._header = read_gguf(self.path)
        return src

    def put_tensor(self, name: str, data: bytes) -> TensorEntry:
        """Check and store one tensor; ManifestError (and nothing written) if its bytes are not the file's."""
        t = self.manifest.check_tensor(name, data)
        self._write(self.manifest.span(t)[0], data, name)
        return t

    def cut(self, start: int, end: int, out_path: str, progress=None) -> ShardInfo:
        """The shard of layers [start, end), cut from the parts here; MissingParts if any is not."""
        missing = [t.name for t in self.missing(start, end)]
        if missing:
            raise MissingParts(missing)
        return cut_shard(self.path, start, end, out_path, source_sha256=self.manifest.source_sha256, progress=progress)

    # --- the journal ----------------------------------------------------------

    def _write(self, offset: int, data: bytes, name: str) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, data, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(self._journal, "a", encoding="utf-8") as j:
            j.write(json.dumps(name) + "\n")
            j.flush()
            os.fsync(j.fileno())
        self.present.add(name)

    def _recover(self) -> None:
        """Believe a journaled part only if its bytes still hash right; rewrite the
        journal when a line was torn (a kill mid-append) or a part is dropped."""
        try:
            with open(self._journal, encoding="utf-8") as j:
                lines = [line for line in j.read().split("\n") if line]
        except FileNotFoundError:
            return
        names: list[str] = []
        for line in lines:
            try:
                name = json.loads(line)
            except ValueError:
                continue  # torn
            if isinstance(name, str) and name not in names:
                names.append(name)
        kept = [n for n in names if self._still_here(n)]
        if len(kept) != len(lines):
            self._rewrite(kept)
        self.present = set(kept)
        if HEADER in self.present:
            self._header = read_gguf(self.path)

    def _still_here(self, name: str) -> bool:
        m = self.manifest
        if name == HEADER:
            lo, hi, want = 0, m.header_size, m.header_sha256
        else:
            try:
                t = m.tensor(name)
            except ManifestError:
                return False
            (lo, hi), want = m.span(t), t.sha256
        h = hashlib.sha256()
        try:
            with open(self.path, "rb") as f:
                for chunk in read_range(f, lo, hi - lo, short="the partial model file shrank"):
                    h.update(chunk)
        except (OSError, GGUFFormatError):
            return False
        return h.digest() == want

    def _rewrite(self, names: Iterable[str]) -> None:
        tmp = self._journal + ".tmp"
        with open(tmp, "w", encoding="utf-8") as j:
            j.writelines(json.dumps(n) + "\n" for n in names)
            j.flush()
            os.fsync(j.fileno())
        os.replace(tmp, self._journal)
