"""What one address reconnecting in a loop costs a peer's data plane.

A client that a peer made give way (its source over the connection cap) may
reconnect at once, for ever: h2load does (tests/test_floods.py). Each TLS
handshake costs the peer CPU. This opens ``--connections`` TLS connections one
after another from one process (one source), each closed once its handshake
is done, against a data-plane ``Server`` in this process, twice: with the
per-source connection budget off, and with the default one
(``server.CONNECTIONS_PER_SOURCE_PER_S`` after a burst of
``CONNECTION_BURST_PER_SOURCE``). Reported: the server's CPU per connection
(this process's CPU: the client is another process), the handshakes a second
the loop got, and the share of one core the server spent on them.

    python bench/handshake.py --connections 300 --json
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dataplane.transport.server import CONNECTIONS_PER_SOURCE_PER_S, Server
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials

CLIENT = """
import ssl, socket, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["h2"])
done = 0
for _ in range({n}):
    s = socket.create_connection(("127.0.0.1", {port}), timeout=30)
    try:
        ctx.wrap_socket(s).close(); done += 1
    except OSError:  # closed before the handshake: over the budget
        s.close()
print(done)
"""


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def loop(n: int, rate: float) -> dict:
    srv = Server(make_tls_credentials(Identity.generate()), connections_per_source_per_s=rate).start()
    try:
        c0, t0 = _cpu_s(), time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CLIENT.format(n=n, port=srv.port)], check=True,
                             capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        done = int(out.stdout.strip())
        srv.wait_no_connections(10.0)  # the last connections' threads end
        cpu = _cpu_s() - c0
    finally:
        srv.stop(0)
    return {"connections": n, "handshakes": done, "wall_s": round(wall, 2),
            "handshakes_per_s": round(done / wall, 1), "server_cpu_ms_per_handshake": round(1000 * cpu / max(1, done), 2),
            "server_core_share": round(cpu / wall, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, connections=20)
    off = loop(args.connections, 1e9)
    on = loop(args.connections, CONNECTIONS_PER_SOURCE_PER_S)
    doc = {"budget_off": off, "budget_on": on,
           "core_share_ratio": round(on["server_core_share"] / off["server_core_share"], 3) if off["server_core_share"] else None}
    print_report(doc, args.json)
    ok = off["handshakes"] == args.connections and on["handshakes"] >= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
