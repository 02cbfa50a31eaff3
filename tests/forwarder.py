"""A loopback TCP forwarder for multi-process tests: bytes spliced as they are
(TLS runs end to end through it), outgoing connections from a chosen source
address, the target settable after start (a peer's port is known only once it
listens: a connection that comes first waits for it, up to 10 s), a count
of the connections it carried, and a cut that ends them all."""

from __future__ import annotations

import socket
import threading


class Forwarder:
    def __init__(self, target: tuple[str, int] | None = None, *, source: str = "127.0.0.1") -> None:
        self._target_set = threading.Event()
        self.target = target
        self.source = source
        self.carried = 0  # connections spliced to the target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._spliced: list[socket.socket] = []  # both ends of every connection carried (cut() ends them)
        self._start(self._accept)

    @property
    def target(self) -> tuple[str, int] | None:
        return self._target

    @target.setter
    def target(self, value: tuple[str, int] | None) -> None:
        self._target = value
        if value is not None:
            self._target_set.set()

    def _start(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                inner, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._start(self._connect, inner)

    def _connect(self, inner: socket.socket) -> None:
        try:
            if not self._target_set.wait(10):
                raise OSError("no target")
            outer = socket.create_connection(self.target, timeout=10, source_address=(self.source, 0))
        except OSError:
            inner.close()
            return
        self.carried += 1
        self._spliced += [inner, outer]
        for a, b in ((inner, outer), (outer, inner)):
            self._start(self._pipe, a, b)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for t in self._threads[:1]:  # the acceptor; pipes end with their connections
            t.join(timeout=10)

    def cut(self) -> None:
        """Stop carrying: no new connection is taken, and every one carried is shut
        (a client sees its connection end, with nothing from the peer)."""
        self.close()
        for s in list(self._spliced):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
