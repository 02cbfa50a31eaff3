"""HTTP/2 frames as a peer on the wire may send them, well formed or not (tests only:
the product's HTTP/2 is the h2 library, in dataplane/grpc_core.py)."""

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags, stream_id) + bytes(payload)


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Split bytes (after an optional client preface) into (type, flags, stream, payload);
    a partial frame at the end is left out."""
    out, pos = [], len(PREFACE) if data.startswith(PREFACE) else 0
    while pos + 9 <= len(data):
        n = int.from_bytes(data[pos:pos + 3], "big")
        if pos + 9 + n > len(data):
            break
        sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        out.append((data[pos + 3], data[pos + 4], sid, data[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return out


def request_headers(enc, path: str, *, method: str = "POST", authority: str = "meshnet-peer") -> bytes:
    """A gRPC call's request header block, HPACK-coded with ``enc`` (an hpack.Encoder)."""
    return enc.encode([(":method", method), (":scheme", "https"), (":path", path), (":authority", authority),
                       ("content-type", "application/grpc"), ("te", "trailers")])
