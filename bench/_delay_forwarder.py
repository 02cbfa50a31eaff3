"""A userspace link with delay, as its own process (these kernels have no netem).

    python bench/_delay_forwarder.py DELAY_MS

Commands on stdin, one per line: ``listen`` opens a forwarding port on
127.0.0.1 and prints it; ``target PORT HOST:PORT`` sets where that port's
connections go (a peer's port is known only once it listens, and it must
announce the forwarder's port before that). Each chunk read in either
direction is written DELAY_MS after it was read, in order, so a crossing
costs DELAY_MS (plus this process's ~0.1-0.7 ms) and bandwidth is not
throttled. Bytes pass as they are: TLS runs end to end through it.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
import time

try:  # with MESHNET_TRACE set, each chunk's read and write is an event (docs/ring.md, "Trace")
    from meshnet_p2p.core import trace
except ImportError:  # run outside the project's environment: no trace
    trace = None
DELAY = float(sys.argv[1]) / 1000
targets: dict[int, tuple[str, int]] = {}
target_set = threading.Condition()


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Read chunks as they come; a writer sends each DELAY after it was read."""
    queue: collections.deque = collections.deque()
    ready = threading.Condition()

    def writer() -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, data = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the link's delay itself
            if data is None:
                break
            if trace is not None:
                trace.event("link.write", n=len(data), port=src.getsockname()[1])
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=writer, daemon=True).start()
    while True:
        try:
            data = src.recv(1 << 16)
        except OSError:
            data = b""
        if trace is not None and data:
            trace.event("link.read", n=len(data), port=src.getsockname()[1])
        with ready:
            queue.append((time.monotonic() + DELAY, data or None))
            ready.notify()
        if not data:
            return


def serve(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    while True:
        inner, _ = listener.accept()
        threading.Thread(target=connect, args=(port, inner), daemon=True).start()


def connect(port: int, inner: socket.socket) -> None:
    # a connection before the target is known (a peer's reachability check) waits for it
    with target_set:
        target_set.wait_for(lambda: port in targets, timeout=10)
        target = targets.get(port)
    try:
        if target is None:
            raise OSError("no target")
        outer = socket.create_connection(target, timeout=10)
        outer.settimeout(None)  # the 10 s bound the connect only: an idle link stays up, as a real one does
    except OSError:
        inner.close()
        return
    for s in (inner, outer):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for a, b in ((inner, outer), (outer, inner)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()


def main() -> None:
    if trace is not None:
        trace.name("link")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["listen"]:
            listener = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=serve, args=(listener,), daemon=True).start()
            print(listener.getsockname()[1], flush=True)
        elif cmd[:1] == ["target"] and len(cmd) == 3:
            host, _, port = cmd[2].rpartition(":")
            with target_set:
                targets[int(cmd[1])] = (host, int(port))
                target_set.notify_all()
            print("ok", flush=True)


if __name__ == "__main__":
    main()
