"""A simulated run's measures, summed up for bench/sim.py (simulated seconds)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from .clients import Measures

if TYPE_CHECKING:
    from .swarm import SimConfig


@dataclass
class Part:
    """What one process of a run measured (split.py: two are added up), and the report's inputs."""
    span: float  # simulated seconds measured
    sent: int  # datagrams sent while measuring, and their bytes
    sent_bytes: int
    rss_bytes: int  # peak RSS growth
    m: Measures
    kinds: Counter
    kind_bytes: Counter
    full_key: Counter
    lost: int  # datagrams lost, and dropped by a partition, over the whole run
    partitioned: int
    waited_s: list[float] = dataclasses.field(default_factory=list)  # split.py: each half's wall time waiting for the other
    queue_dropped: int = 0  # of the lost, dropped by a full uplink queue (net.py)

    def pack(self) -> bytes:
        return msgpack.packb({**{k: getattr(self, k) for k in ("span", "sent", "sent_bytes", "rss_bytes", "lost",
                                                               "partitioned", "waited_s", "queue_dropped")},
                              "m": dataclasses.asdict(self.m), "kinds": dict(self.kinds),
                              "kind_bytes": [[k, part, v] for (k, part), v in self.kind_bytes.items()],
                              "full_key": dict(self.full_key)}, use_bin_type=True)

    def add(self, packed: bytes) -> None:
        """Add the other process's part (``pack``): its counts, its samples."""
        d = msgpack.unpackb(packed, raw=False)
        self.sent += d["sent"]
        self.sent_bytes += d["sent_bytes"]
        self.rss_bytes += d["rss_bytes"]
        self.lost += d["lost"]
        self.partitioned += d["partitioned"]
        self.waited_s.extend(d["waited_s"])
        self.queue_dropped += d["queue_dropped"]
        self.kinds.update(d["kinds"])
        self.kind_bytes.update({(k, part): v for k, part, v in d["kind_bytes"]})
        self.full_key.update(d["full_key"])
        for f in dataclasses.fields(Measures):
            mine, theirs = getattr(self.m, f.name), d["m"][f.name]
            if isinstance(mine, list):
                mine.extend(theirs)
            elif isinstance(mine, int):
                setattr(self.m, f.name, mine + theirs)
            # (grace_s and wall_phases: this process's, the one that reports)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _share(items: list[dict], pred) -> float | None:
    return _r3(sum(1 for x in items if pred(x)) / len(items)) if items else None


def _counts(items) -> dict[str, int]:
    return dict(Counter(items))


def _mean(values: list[float]) -> float | None:
    return _r3(sum(values) / len(values)) if values else None


def _missed(missed: list[dict]) -> dict[str, Any]:
    """The volunteers model lookups missed, and where their records were: how many
    nodes held each, and the rank from the key of the nearest (0: the nearest server
    online; a lookup reads about the 20 nearest along each of its paths)."""
    ranks = [x["nearest_rank"] for x in missed if x["nearest_rank"] is not None]
    return {
        "model_lookup_missed": len(missed),  # volunteer-lookup pairs
        "model_lookup_missed_volunteers": len({x["signer"] for x in missed}),
        "model_lookup_missed_holders_p50": _pct([x["holders"] for x in missed], 0.5),
        "model_lookup_missed_nearest_rank_p50": _pct(ranks, 0.5),
        "model_lookup_missed_nearest_rank_p10": _pct(ranks, 0.1),
        "model_lookup_missed_unheld": sum(1 for x in missed if x["nearest_rank"] is None),
    }


def _surveys(surveys: list[dict], prefix: str) -> dict[str, Any]:
    routed = [x for x in surveys if x["outcome"] == "route"]
    generated = [x for x in routed if "generation" in x]
    outcomes = _counts(x["outcome"] for x in surveys)
    return {
        f"{prefix}surveys": len(surveys),
        f"{prefix}route_found": _share(surveys, lambda x: x["outcome"] == "route"),
        f"{prefix}survey_outcomes": outcomes,
        f"{prefix}survey_s_p50": _r3(_pct([x["s"] for x in surveys], 0.5)),
        f"{prefix}survey_s_p90": _r3(_pct([x["s"] for x in surveys], 0.9)),
        f"{prefix}vouched_mean": _mean([x.get("vouched", 0) for x in surveys]),
        f"{prefix}failed_contacts_mean": _mean([x["failed_contacts"] for x in surveys]),
        # first contacts still out when a round stopped waiting for them (a made-up address hangs)
        f"{prefix}abandoned_contacts_mean": _mean([x.get("abandoned_contacts", 0) for x in surveys]),
        f"{prefix}contact_rounds_p90": _pct([x["contact_rounds"] for x in surveys], 0.9),
        # opening the route: rounds of first contacts until a plan of peers that answered stands
        f"{prefix}open_s_p50": _r3(_pct([x["open_s"] for x in routed], 0.5)),
        f"{prefix}open_s_p90": _r3(_pct([x["open_s"] for x in routed], 0.9)),
        f"{prefix}route_quality_p50": _r3(_pct([x["quality"] for x in routed if x["quality"]], 0.5)),
        f"{prefix}route_quality_p90": _r3(_pct([x["quality"] for x in routed if x["quality"]], 0.9)),
        # had the client measured its round trip to every candidate first (star pricing)
        f"{prefix}route_quality_rtt_p50": _r3(_pct([x["quality_rtt"] for x in routed if x.get("quality_rtt")], 0.5)),
        f"{prefix}route_quality_rtt_p90": _r3(_pct([x["quality_rtt"] for x in routed if x.get("quality_rtt")], 0.9)),
        # of every survey: found a route and generated every token on it (failing over as peers left)
        f"{prefix}generated": _share([x for x in surveys if x["outcome"] != "route" or "generation" in x],
                                     lambda x: x.get("generation") == "complete"),  # (those the run's end cut: out)
        f"{prefix}generation_outcomes": _counts(x["generation"] for x in generated),
        f"{prefix}failed_over": sum(1 for x in generated if x["failovers"]),
        f"{prefix}completed_after_failover": sum(1 for x in generated if x["failovers"] and x["generation"] == "complete"),
        f"{prefix}generation_s_p50": _r3(_pct([x["generation_s"] for x in generated], 0.5)),
        # waiting out a step's timeout on a hop whose machine vanished (Churn.vanish_share)
        f"{prefix}stalled_on_vanished": sum(1 for x in generated if x["stalled_s"]),
        f"{prefix}stalled_s_mean": _mean([x["stalled_s"] for x in generated if x["stalled_s"]]),
    }


def _coverage(samples: list[dict], prefix: str) -> dict[str, Any]:
    """How evenly the announced volunteers cover a model's layers: the share of samples with
    a layer nobody serves, and the fewest volunteers on a layer against the mean."""
    return {
        f"{prefix}hole_share": _share(samples, lambda x: x["min"] == 0),
        f"{prefix}cover_min_mean": _mean([x["min"] for x in samples]),
        f"{prefix}cover_mean": _mean([x["mean"] for x in samples]),
    }


def report(cfg: "SimConfig", part: "Part", online: float, peak: int, wall_s: float) -> dict:
    """``part``: what the run measured (both processes' of a split run, added up)."""
    m, span, sent, sent_bytes = part.m, part.span, part.sent, part.sent_bytes
    ml, nl = m.model_lookups, m.node_lookups
    doc = {
        "peers": cfg.peers, "procs": cfg.procs, "simulated_s": round(span), "warmup_s": round(cfg.warmup_minutes * 60),
        "grace_s": round(m.grace_s, 1), "wall_s": round(wall_s, 1),
        "wall_s_by_phase": {k: round(v, 1) for k, v in m.wall_phases.items()}, "seed": cfg.seed,
        # a split run: the wall seconds each half waited at the meeting points for the other (its imbalance)
        **({"split_waited_s": [round(w, 1) for w in part.waited_s]} if part.waited_s else {}),
        "online_mean": round(online, 1), "online_peak": peak, "joins": m.joins, "leaves": m.leaves,
        "model_lookups": len(ml),
        "model_lookup_recall_mean": _mean([x["recall"] for x in ml]),
        "model_lookup_complete": _share(ml, lambda x: x["found"] == x["live"]),
        "model_lookup_found_any": _share(ml, lambda x: x["found"] or not x["live"]),
        "model_lookup_s_p50": _r3(_pct([x["s"] for x in ml], 0.5)),
        "model_lookup_s_p90": _r3(_pct([x["s"] for x in ml], 0.9)),
        "model_lookup_s_p99": _r3(_pct([x["s"] for x in ml], 0.99)),
        **_missed(m.missed),
        "node_lookups": len(nl),
        "node_lookup_success": _share(nl, lambda x: x["found"]),
        "node_lookup_s_p50": _r3(_pct([x["s"] for x in nl], 0.5)),
        "node_lookup_s_p90": _r3(_pct([x["s"] for x in nl], 0.9)),
        "node_lookup_queried_p50": _pct([x["queried"] for x in nl], 0.5),
        "node_lookup_queried_p90": _pct([x["queried"] for x in nl], 0.9),
        "placement": cfg.placement,
        **_coverage(m.coverage, ""),
        **_surveys(m.surveys, ""),
        "routable_s_p50": _r3(_pct(m.routable_s, 0.5)), "routable_s_p90": _r3(_pct(m.routable_s, 0.9)),
        "never_routable": m.never_routable, "routable_probed": len(m.routable_s) + m.never_routable,
        "messages_per_node_s": _r3(sent / span / max(1.0, online)),
        "bytes_per_node_s": round(sent_bytes / span / max(1.0, online)),
        "requests_per_node_s": {k: _r3(v / span / max(1.0, online)) for k, v in part.kinds.most_common(8)},
        # the bytes a second a node sends, by the request kind they ask or answer
        "bytes_per_node_s_by_kind": {f"{k} {part}": round(v / span / max(1.0, online))
                                     for (k, part), v in part.kind_bytes.most_common(10)},
        # stores that met a key holding its most values (storage.py): refused, or taken in place
        # of a value whose signer the node does not know live
        "full_key_stores_per_node_s": {k: _r3(part.full_key["full_key_" + k] / span / max(1.0, online)) for k in ("refused", "replaced")},
        "lost_datagrams": part.lost,
        **({"uplink_queue_dropped": part.queue_dropped} if cfg.net.uplink_mbps else {}),
        "rss_per_peer_kb": round(part.rss_bytes / 1024 / max(1, peak), 1),
        # gossiped records a peer's node holds (bootstrap peers, which follow every topic, aside)
        "gossip_held_mean": _mean(m.gossip_held),
        "gossip_held_max": max(m.gossip_held, default=0),
    }
    if cfg.relays + cfg.bad_relays:  # NATed volunteers: how many held a reservation (on a relay that carries
        rs = m.relay_samples  # clients), how long finding one took, how many ended, the fullest relay
        natted = max(1, sum(x["natted"] for x in rs))
        doc.update({
            "relays": cfg.relays,
            "bad_relays": cfg.bad_relays,
            "natted_volunteers_relayed": _r3(sum(x["held"] for x in rs) / natted),
            "natted_volunteers_carried": _r3(sum(x["carried"] for x in rs) / natted),
            "relay_losses": m.relay_losses,
            "relay_found_again": sum(1 for x in m.relayed if x["again"]),  # reservations after one was lost
            "relay_found_s_p50": _r3(_pct([x["s"] for x in m.relayed], 0.5)),
            "relay_found_s_p90": _r3(_pct([x["s"] for x in m.relayed], 0.9)),
            "relay_reservations_max": max((x["per_relay"][0] for x in rs if x["per_relay"]), default=0),
            "relay_reservations_last_sample": rs[-1]["per_relay"] if rs else [],
            "relay_capacity": cfg.relay_capacity,
        })
    if cfg.reachability:  # did joining volunteers learn the truth about themselves?
        rc = m.reachability
        public, natted = [x for x in rc if not x["natted"]], [x for x in rc if x["natted"]]
        doc.update({
            "reachability_checks": len(rc),
            "reachability_public_found_reachable": _share(public, lambda x: x["status"] == "reachable"),
            "reachability_natted_found_unreachable": _share(natted, lambda x: x["status"] == "unreachable"),
            "reachability_outcomes": _counts(("natted " if x["natted"] else "public ") + x["status"] for x in rc),
            "reachability_s_p50": _r3(_pct([x["s"] for x in rc], 0.5)),
            "reachability_s_p90": _r3(_pct([x["s"] for x in rc], 0.9)),
        })
    if cfg.partitioned:  # before, during (each side) and after the cut
        doc["partitioned_datagrams"] = part.partitioned
        for phase, pick in (("before", lambda x: x["phase"] == "before"),
                            ("during_inside", lambda x: x["phase"] == "during" and x["cut_side"]),
                            ("during_outside", lambda x: x["phase"] == "during" and not x["cut_side"]),
                            ("after", lambda x: x["phase"] == "after")):
            got = [x for x in ml if pick(x)]
            surveys = [x for x in m.surveys if pick(x)]
            doc[f"partition_{phase}"] = {
                "model_lookups": len(got),
                "found_any": _share(got, lambda x: x["found"] or not x["live"]),
                "recall_mean": _mean([x["recall"] for x in got]),
                "lookup_s_p50": _r3(_pct([x["s"] for x in got], 0.5)),
                "surveys": len(surveys), "route_found": _share(surveys, lambda x: x["outcome"] == "route"),
                "survey_outcomes": _counts(x["outcome"] for x in surveys),
            }
    if cfg.sybils:  # what the attack did to its target (model 0) against the other models
        target = [x for x in ml if x["model"] == 0]
        doc.update({
            "sybils": cfg.sybils, "sybil_behaviour": cfg.sybil_behaviour, "sybil_target": cfg.sybil_target,
            "sybil_networks": cfg.sybil_networks,
            "target_model_lookup_recall_mean": _mean([x["recall"] for x in target]),
            **_coverage([x for x in m.coverage if x["model"] == 0], "target_"),
            **_surveys([x for x in m.surveys if x["model"] == 0], "target_"),
            **_surveys([x for x in m.surveys if x["model"] != 0], "other_"),
        })
    return doc
