"""One tree's direct hop for bench/hop_ab.py: a `meshnet-peer serve` process
and a client, both from whichever meshnet_p2p is first on PYTHONPATH.

    _hop_worker.py SHARD THREADS N_CTX N_EMBD

Prints ``ready <tree>``, then for each ``START N`` line on stdin steps tokens
START..START+N-1 and prints one JSON line: each step's seconds and the sha256
of each output. Uses only API that trees before and after issue 12 share, in either layout
(flat modules before issue 25, subpackages after).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import meshnet_p2p
try:  # the layout of issue 25 on
    from meshnet_p2p.dataplane.stub import ShardClient, open_channel
    from meshnet_p2p.dataplane.transport.tls import verify_binding
    from meshnet_p2p.core.multiaddr import Multiaddr
    from meshnet_p2p.roles.peer_process import PeerProcess
    from meshnet_p2p.core.records import wall_ms
except ImportError:  # a tree before it: the same API, flat modules
    from meshnet_p2p.dataplane.client import ShardClient, open_channel
    from meshnet_p2p.dataplane.tls import verify_binding
    from meshnet_p2p.multiaddr import Multiaddr
    from meshnet_p2p.peer_process import PeerProcess
    from meshnet_p2p.records import wall_ms

from _hidden import hidden_states


def main() -> int:
    shard, threads, n_ctx, n_embd = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = PeerProcess("serve", "--shard", shard, "--threads", threads)
    try:
        addr = Multiaddr.parse(server.address())
        cert = verify_binding(bytes.fromhex(server.wait_line("tls-binding ").split()[1]), addr.peer_id, wall_ms())
        client = ShardClient(open_channel(cert, address=(addr.host, addr.port)))
        stream = client.session(client.capability().fingerprint, max_tokens=n_ctx)
        hidden = hidden_states(n_ctx, n_embd)
        print("ready", os.path.dirname(os.path.dirname(os.path.abspath(meshnet_p2p.__file__))), flush=True)
        for line in sys.stdin:
            start, n = map(int, line.split())
            times, digests = [], []
            for i in range(start, start + n):
                t0 = time.perf_counter()
                out = stream.step(i, hidden=hidden[i], decode=True).hidden.tensors[0].data
                times.append(time.perf_counter() - t0)
                digests.append(hashlib.sha256(out).hexdigest())
            print(json.dumps({"times": times, "digests": digests}), flush=True)
        stream.release()
        client.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
