"""What the `h2` library's protocol core costs per gRPC-like round trip, in memory
(issue 12 groundwork; see docs/h2-migration.md).

    python bench/h2_core.py [N] [--smoke]

One client and one server H2Connection, one bidirectional stream, N ping-pong
messages of a 5-byte prefix + 2,304 bytes (one SmolLM2 hidden row) each way,
with default and 16 MiB windows; then the per-frame floor of receive_data.
No sockets, no TLS: the protocol core alone, to set against bench/hop.py.
"""
import struct
import sys
import time
import h2, hpack, hyperframe
from h2.connection import H2Connection
from h2.config import H2Configuration
from h2.events import DataReceived
from h2.settings import SettingCodes

N = 10_000  # round trips (main sets it from the command line)
PAYLOAD = b"x" * 2304
MSG = struct.pack(">BI", 0, len(PAYLOAD)) + PAYLOAD  # 2309 bytes

def setup(big_windows):
    c = H2Connection(H2Configuration(client_side=True))
    s = H2Connection(H2Configuration(client_side=False))
    c.initiate_connection(); s.initiate_connection()
    if big_windows:
        for conn in (c, s):
            conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 2**24})
            conn.increment_flow_control_window(2**24)
    s.receive_data(c.data_to_send()); c.receive_data(s.data_to_send())
    s.receive_data(c.data_to_send()); c.receive_data(s.data_to_send())
    sid = c.get_next_available_stream_id()
    c.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/pkg.Svc/Method"),
                         (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
    s.receive_data(c.data_to_send())
    s.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
    c.receive_data(s.data_to_send())
    return c, s, sid

def run(big_windows):
    c, s, sid = setup(big_windows)
    t_send = t_recv = 0.0
    pc = time.perf_counter
    t0 = pc()
    for _ in range(N):
        a = pc(); c.send_data(sid, MSG); out = c.data_to_send(); b = pc()
        ev = s.receive_data(out)
        for e in ev:
            if isinstance(e, DataReceived):
                s.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        d = pc()
        s.send_data(sid, MSG); out = s.data_to_send(); f = pc()
        ev = c.receive_data(out)
        for e in ev:
            if isinstance(e, DataReceived):
                c.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        w = c.data_to_send()          # WINDOW_UPDATEs, if any
        if w: s.receive_data(w)
        g = pc()
        t_send += (b - a) + (f - d); t_recv += (d - b) + (g - f)
    total = pc() - t0
    return total, t_send, t_recv

def tiny_frames():
    """cost per receive_data of tiny DATA frames (1 frame/call) and batched."""
    c, s, sid = setup(True)
    frames = []
    for _ in range(N):
        c.send_data(sid, b"\x00\x00\x00\x00\x01z"); frames.append(c.data_to_send())
    pc = time.perf_counter
    t = pc()
    for fr in frames: s.receive_data(fr)
    one = (pc() - t) / N
    c, s, sid = setup(True)
    for _ in range(N): c.send_data(sid, b"\x00\x00\x00\x00\x01z")
    blob = c.data_to_send()
    t = pc(); s.receive_data(blob); batched = (pc() - t) / N
    return one, batched

if __name__ == "__main__":
    import argparse

    from _smoke import parse_args  # bench/ is on sys.path when a bench runs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("n", nargs="?", type=int, default=N, help="round trips")
    N = parse_args(ap, n=200).n
    print(f"python {sys.version.split()[0]}  h2 {h2.__version__} hpack {hpack.__version__} hyperframe {hyperframe.__version__}")
    print(f"{N} round trips, message {len(MSG)} B each way, 1 stream\n")
    for big in (False, True):
        best = min((run(big) for _ in range(3)), key=lambda r: r[0])
        total, ts, tr = best
        label = "default windows (64 KiB, ack every msg)" if not big else "16 MiB windows"
        print(f"{label:42s}: {total/N*1e6:7.1f} us/round-trip "
              f"(send_data+data_to_send {ts/(2*N)*1e6:5.1f} us/msg, "
              f"receive_data+ack {tr/(2*N)*1e6:5.1f} us/msg); "
              f"{2*N*len(MSG)/total/1e6:.1f} MB/s payload")
    one, batched = tiny_frames()
    print(f"receive_data, 15-byte DATA frame, 1 frame/call : {one*1e6:5.1f} us/frame")
    print(f"receive_data, 15-byte DATA frames, {N} per call: {batched*1e6:5.1f} us/frame")
