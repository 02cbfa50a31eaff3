"""Datagram transports for the DHT: real UDP on trio, and the interface a fake
network (``meshnet_p2p.testing``) implements for in-process swarms."""

from __future__ import annotations

from typing import Protocol

import trio

Addr = tuple[str, int]


class DatagramTransport(Protocol):
    local_addr: Addr

    async def send(self, data: bytes, addr: Addr) -> None: ...

    async def receive(self) -> tuple[bytes, Addr]: ...

    def close(self) -> None: ...


class UdpTransport:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.local_addr = (host, port)

    @classmethod
    async def bind(cls, host: str = "127.0.0.1", port: int = 0) -> "UdpTransport":
        family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
        sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
        await sock.bind((host, port))
        return cls(sock)

    async def send(self, data: bytes, addr: Addr) -> None:
        try:
            await self._sock.sendto(data, addr)
        except OSError:
            pass  # unreachable peers look like silent ones; the request times out

    async def receive(self) -> tuple[bytes, Addr]:
        while True:
            try:
                data, addr = await self._sock.recvfrom(65536)
                return data, (addr[0], addr[1])
            except ConnectionError:
                continue  # ICMP errors from an earlier send surface here on some systems

    def close(self) -> None:
        self._sock.close()
