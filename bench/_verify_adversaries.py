"""bench/verify.py's adversaries (issue 59): per attacker, what fresh users got, who
was convicted, and what the default policy costs an honest swarm. The scenarios
are tests/adversaries.py's (the tests assert on them; this measures them).

- sleeper, trigger: wrong answers delivered (returned, as the CLI's exit 0) over
  ``clients`` fresh clients after the flip, withheld ones, honest peers convicted;
- sybil: the same with ``--verify always`` and with ``auto``, and what a review
  beside the pair convicted and vouched;
- framing: ``forged`` false reports against an honest whole-model peer; a fresh
  client's wait (its answer, then what the CLI waits for) with them against
  without, median of ``clients`` each, in turns;
- cost: the honest swarm (no attacker), the default policy (``auto``, audits)
  against verification off (``off``, no audits), fresh clients in turns: the
  peers' CPU seconds (every process's, from /proc), the time to the answer
  (``answer_ratio``: what the user waits for) and until the CLI would exit
  (``exit_ratio``: the answer, then the audits it waits for); and a returning
  user (one client kept across ``clients`` generations, its records growing)
  likewise; and ``whole_model``: the same for fresh users beside a vouched
  honest whole-model peer (one identity computing every layer, which a client
  that has not checked it itself runs beside a second route).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from tests.adversaries import PLAIN, TRIGGERED, HonestSwarm, Through, answers, forge_reports, fresh_client, \
    fresh_clients
from tests.swarm import own_address


def cpu_seconds(procs) -> float:
    """User and system CPU seconds of these processes so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        try:
            with open(f"/proc/{p.p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def tally(outcomes) -> dict:
    whats = [o.what for o in outcomes]
    return {"clients": len(whats), "wrong_delivered": whats.count("WRONG"), "withheld": whats.count("withheld")}


def convicted_honest(swarm: HonestSwarm, doc: dict, extra=()) -> int:
    honest = {p.peer_id for p in (*swarm.joins, *extra)}
    return len(honest & set(doc.get("convicted", {})))


def run(model_path: str, clients: int, forged: int, tokens: int) -> dict:
    said = answers(model_path, PLAIN + TRIGGERED, tokens)
    plain = [PLAIN[i % len(PLAIN)] for i in range(clients)]
    out: dict = {"clients": clients, "tokens": tokens}
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-adversaries-") as tmp, HonestSwarm(tmp) as swarm:
        env_cache = os.environ.get("MESHNET_CACHE_DIR")
        os.environ["MESHNET_CACHE_DIR"] = tmp  # the in-process clients' cache: this run's
        try:
            # the honest swarm's default cost, before any attacker: fresh users, in turns
            walls, answered, cpu = {"off": [], "auto": []}, {"off": [], "auto": []}, {"off": 0.0, "auto": 0.0}
            for prompt in plain:
                for mode in ("off", "auto"):
                    before = cpu_seconds(swarm.procs)
                    o = fresh_client(swarm.addr, prompt, said[prompt], verify=mode, tokens=tokens,
                                     audits=mode != "off")
                    cpu[mode] += cpu_seconds(swarm.procs) - before
                    walls[mode].append(o.wait_s)
                    answered[mode].append(o.answer_s)
            returning = _returning(swarm, plain, said, tokens)
            out["cost"] = {
                "fresh": {"compute_ratio": round(cpu["auto"] / max(cpu["off"], 1e-9), 3),
                          "answer_ratio": ratio(answered), "answer_s_off": round(statistics.median(answered["off"]), 3),
                          "exit_ratio": ratio(walls)},
                "returning": returning}

            # the sleeper: vouched by a review while honest, then lying
            flip = os.path.join(tmp, "flip")
            sleeper = swarm.liar("sleeper", "--flip-file", flip)
            try:
                swarm.review()
                open(flip, "w").close()
                first = fresh_client(swarm.addr, plain[0], said[plain[0]], tokens=tokens, through=sleeper.peer_id)
                got = [first, *fresh_clients(swarm.addr, plain[1:], said, tokens=tokens)]
                out["sleeper"] = {**tally(got), "first_client_sent_to_it": True,
                                  "honest_convicted": convicted_honest(swarm, swarm.review())}
            finally:
                sleeper.stop()

            # the trigger: lies only on " bank"
            liar = swarm.liar("trigger")
            try:
                swarm.review()
                prompts = [(TRIGGERED if i % 2 else PLAIN)[(i // 2) % 5] for i in range(clients)]
                got = fresh_clients(swarm.addr, prompts, said, tokens=tokens)
                out["trigger"] = {**tally(got), "honest_convicted": convicted_honest(swarm, swarm.review())}
            finally:
                liar.stop()

            # the Sybil pair: two hijackers on one address, beside an honest whole-model peer
            whole, sybils = swarm.join("0:30"), []
            try:
                host = own_address()
                sybils = [swarm.liar("hijack", host=host) for _ in range(2)]
                always = fresh_clients(swarm.addr, plain, said, verify="always", tokens=tokens)
                doc = swarm.review()
                auto = fresh_clients(swarm.addr, plain, said, tokens=tokens)
                out["sybil"] = {"always": tally(always), "auto": tally(auto),
                                "honest_convicted": convicted_honest(swarm, doc, [whole]),
                                "sybils_vouched": len({s.peer_id for s in sybils} & set(doc.get("verified", {})))}
            finally:
                for p in sybils:
                    p.stop()
                whole.stop()

            # framing: forged reports against an honest whole-model peer the review vouched for
            framed = swarm.join("0:30")
            try:
                swarm.review()
                # first, what a vouched honest whole-model peer costs fresh users: one identity
                # computing every layer runs beside a second route until a client checked it itself
                clean, off, cpu = [], [], {"off": 0.0, "auto": 0.0}
                for prompt in plain:
                    for mode in ("off", "auto"):
                        before = cpu_seconds(swarm.procs)
                        o = fresh_client(swarm.addr, prompt, said[prompt], verify=mode, tokens=tokens,
                                         audits=mode != "off")
                        cpu[mode] += cpu_seconds(swarm.procs) - before
                        (clean if mode == "auto" else off).append(o)
                out["cost"]["whole_model"] = {
                    "compute_ratio": round(cpu["auto"] / max(cpu["off"], 1e-9), 3),
                    "answer_ratio": round(statistics.median(o.answer_s for o in clean)
                                          / statistics.median(o.answer_s for o in off), 3),
                    "exit_ratio": round(statistics.median(o.wait_s for o in clean)
                                        / statistics.median(o.wait_s for o in off), 3),
                    "right": sum(o.what == "right" for o in clean)}
                framed_waits = []
                stored = forge_reports(swarm.addr, framed.peer_id, forged, sessions=2)
                for prompt in plain:
                    framed_waits.append(fresh_client(swarm.addr, prompt, said[prompt], tokens=tokens))
                doc = swarm.review()
                out["framing"] = {"forged": forged, "stored": stored, **tally(framed_waits),
                                  "answer_ratio": round(statistics.median(o.answer_s for o in framed_waits)
                                                        / statistics.median(o.answer_s for o in clean), 3),
                                  "exit_ratio": round(statistics.median(o.wait_s for o in framed_waits)
                                                      / statistics.median(o.wait_s for o in clean), 3),
                                  "honest_convicted": convicted_honest(swarm, doc, [framed])}
            finally:
                framed.stop()
        finally:
            if env_cache is None:
                os.environ.pop("MESHNET_CACHE_DIR", None)
            else:
                os.environ["MESHNET_CACHE_DIR"] = env_cache
    return out


def _returning(swarm: HonestSwarm, prompts, said, tokens) -> dict:
    """One user's client kept across generations (its records grow, its audits thin out),
    against the same with verification off, in turns."""
    walls, answered, cpu = {"off": [], "auto": []}, {"off": [], "auto": []}, {"off": 0.0, "auto": 0.0}
    clients = {"off": Through([swarm.addr], verify="off"), "auto": Through([swarm.addr])}
    clients["off"].auditor.submit = lambda items, peers=(): None
    try:
        for prompt in prompts:
            for mode, c in clients.items():
                before, t0 = cpu_seconds(swarm.procs), time.perf_counter()
                c.generate(prompt, tokens, stop_at_eog=False)
                answered[mode].append(time.perf_counter() - t0)
                c.wait_audits(300)
                walls[mode].append(time.perf_counter() - t0)
                cpu[mode] += cpu_seconds(swarm.procs) - before
    finally:
        for c in clients.values():
            c.close()
    return {"generations": len(prompts), "compute_ratio": round(cpu["auto"] / max(cpu["off"], 1e-9), 3),
            "answer_ratio": ratio(answered), "exit_ratio": ratio(walls)}


def ratio(times: dict) -> float:
    """Median wall time with the default policy over the same with verification off."""
    return round(statistics.median(times["auto"]) / statistics.median(times["off"]), 3)
