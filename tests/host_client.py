"""A client run as its own process inside a simulated host (tests/test_nat.py).

    python tests/host_client.py BOOTSTRAP PROMPT MAX_TOKENS [PAUSE_AT [star]]

Generates greedily through the swarm (the ring, the default) and prints, as
they happen: ``token N`` after each token, ``event ...`` for each client
event (failovers), and at the end ``result {json}`` (token ids, route,
failovers). With PAUSE_AT, after that many tokens it prints ``paused`` and
waits for a line on stdin before going on: a test changes the swarm there.
With ``star`` the client drives every hop itself (no ring): the ring's peers
compute ahead of a client that stops reading, so only a star stops where the
client pauses.
"""

import json
import sys

from meshnet_p2p.client import Client


def main() -> None:
    boot, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause_at = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "0" else None
    ring = sys.argv[5:6] != ["star"]
    seen = 0

    def on_token(_text: str) -> None:
        nonlocal seen
        seen += 1
        print(f"token {seen}", flush=True)
        if seen == pause_at:
            print("paused", flush=True)
            sys.stdin.readline()

    # peers here die by signal (noticed at once), not by freezing: a generous step timeout keeps a
    # machine busy with a whole simulated swarm from passing a slow step for a dead peer
    client = Client([boot], step_timeout=30.0, on_event=lambda e: print(f"event {e}", flush=True), ring=ring)
    r = client.generate(prompt, max_tokens, stop_at_eog=False, on_token=on_token)
    print("result " + json.dumps({"token_ids": r.token_ids, "route": r.route, "failovers": r.failovers}), flush=True)


if __name__ == "__main__":
    main()
