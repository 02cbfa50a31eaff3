"""Fetching parts of a model file from peers (proto/weights.proto, docs/weights.md).

:func:`fetch_parts` fills a
partial model (engine/partial.py) with the parts asked for, from several
sources at once: each part from a source that holds it and is least busy,
checked against the manifest before it is stored. A source that serves a part
that is not the file's, or breaks, is set aside for the rest of the fetch and
its part asked of another; one that is only busy (RESOURCE_EXHAUSTED) is asked
again later. A slow source costs at most one part's wait: once nothing is left
to ask, a part still coming from one source is asked of an idle other too
(BitTorrent's endgame), the first to arrive whole and checked is kept and the
other call cancelled. The fetch fails, naming the parts, only when no source is left
for some part. What was stored stays stored (the partial model's journal), so
a fetch killed at any point resumes with the parts it has.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.engine.manifest import ManifestError
from meshnet_p2p.engine.partial import HEADER, PartialModel
from meshnet_p2p.dataplane.transport.channel import ChannelError
from meshnet_p2p.dataplane.weights import WeightClient

BUSY_RETRIES = 30  # a part asked again this many times of busy sources before the fetch gives up on it
BUSY_WAIT_S = 0.2


class FetchError(MeshnetError):
    """Parts no source could give (each named, with why)."""


@dataclass
class FetchReport:
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)  # source -> why
    busy_retries: int = 0
    duplicates: int = 0  # parts asked of a second source in the endgame

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_source.values())


def fetch_parts(partial: PartialModel, names: Sequence[str], sources: Mapping[str, WeightClient],
                holdings: Mapping[str, frozenset[str] | None], *, parallel: int = 4,
                progress: Callable[[str, int, int], None] | None = None, sleep=time.sleep) -> FetchReport:
    """Store every part of ``names`` not yet in ``partial``, from ``sources`` (name ->
    client); ``holdings``: what each holds (None: everything). Raises FetchError
    naming the parts no source could give; the others stay stored."""
    m = partial.manifest
    digest = m.digest()
    size = {n: (m.header_size if n == HEADER else m.tensor(n).nbytes) for n in names}
    todo = sorted((n for n in dict.fromkeys(names) if n not in partial.present), key=lambda n: -size[n])
    total, done = sum(size[n] for n in todo), 0
    report = FetchReport()
    lock = threading.Lock()
    busy: dict[str, int] = {s: 0 for s in sources}  # parts in flight per source
    tries: dict[str, int] = {}
    failed: dict[str, str] = {}
    asked: dict[str, set[str]] = {}  # part -> the sources fetching it now
    stored: set[str] = set()  # parts stored (or being stored) by this fetch

    def holders(part: str) -> list[str]:
        return [s for s in sources if s not in report.set_aside
                and (holdings.get(s) is None or part in holdings[s])]

    def take() -> tuple[str, str] | None:
        """The next part and the least busy source holding it; None when nothing is left."""
        with lock:
            while todo:
                part = todo.pop(0)
                who = holders(part)
                if not who:
                    why = "; ".join(f"{s}: {report.set_aside[s]}" for s in sources if s in report.set_aside)
                    failed[part] = f"no source holds it{' that was not set aside (' + why + ')' if why else ''}"
                    continue
                source = min(who, key=lambda s: busy[s])
                busy[source] += 1
                asked.setdefault(part, set()).add(source)
                return part, source
            # the endgame: nothing left to ask, so a part coming from one source only is asked of an idle other
            for part, who in asked.items():
                if len(who) == 1 and part not in stored:
                    idle = [s for s in holders(part) if s not in who and busy[s] == 0]
                    if idle:
                        busy[idle[0]] += 1
                        who.add(idle[0])
                        report.duplicates += 1
                        return part, idle[0]
            return None

    def work() -> None:
        nonlocal done
        while (job := take()) is not None:
            part, source = job
            requeue = was_busy = False
            try:
                data = sources[source].part(digest, part, size[part], stop=lambda: part in stored)
                with lock:
                    won = data is not None and part not in stored
                    if won:
                        stored.add(part)
                if won:
                    try:
                        if part == HEADER:
                            partial.put_header(data)
                        else:
                            partial.put_tensor(part, data)
                    except BaseException:
                        with lock:
                            stored.discard(part)
                        raise
                    with lock:
                        report.bytes_by_source[source] = report.bytes_by_source.get(source, 0) + len(data)
                        done += len(data)
                        if progress:
                            progress("fetching", done, total)
            except ChannelError as e:
                with lock:
                    if e.refused:  # busy: this part again later, maybe from another
                        report.busy_retries += 1
                        tries[part] = tries.get(part, 0) + 1
                        if tries[part] > BUSY_RETRIES:
                            failed[part] = f"every source holding it stayed busy ({e.detail})"
                        else:
                            requeue = was_busy = True
                    else:
                        report.set_aside.setdefault(source, f"{e.code}: {e.detail}")
                        requeue = True
            except ManifestError as e:  # the source's bytes are not the file's
                with lock:
                    report.set_aside.setdefault(source, str(e))
                    requeue = True
            finally:
                with lock:
                    busy[source] -= 1
                    who = asked.get(part, set())
                    who.discard(source)
                    if not who:
                        asked.pop(part, None)
                    # asked again unless stored, or still coming from the other source of the endgame
                    if requeue and part not in stored and not who:
                        todo.append(part)
            if was_busy:
                sleep(BUSY_WAIT_S)  # before asking again: the source said it is full now

    threads = [threading.Thread(target=work, name=f"fetch-{i}", daemon=True)
               for i in range(max(1, min(parallel, len(todo))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        shown = "; ".join(f"{p!r}: {why}" for p, why in list(failed.items())[:5])
        raise FetchError(f"{len(failed)} parts could not be fetched: {shown}")
    return report
