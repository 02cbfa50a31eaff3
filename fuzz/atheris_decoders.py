"""Coverage-guided fuzzing (atheris, libFuzzer) of the decoders that read network
input, beside the hypothesis properties in tests/test_fuzz_decoders.py: those
check meaning on structured input, this one explores raw bytes by coverage.

Each target may raise only its decoder's typed error; anything else is a
crash libFuzzer reports with the input that caused it (turn it into a
regression test). CI runs every target for a bounded number of inputs:

    python fuzz/atheris_decoders.py all -runs=4000
    python fuzz/atheris_decoders.py datagram -max_total_time=600   # a longer local run
"""

from __future__ import annotations

import copy
import sys

import atheris

with atheris.instrument_imports(include=["meshnet_p2p", "h2", "hpack", "hyperframe", "h11"]):
    from meshnet_p2p._proto import shard_runtime_pb2 as pb
    from meshnet_p2p.swarm.capability import TYPES
    from meshnet_p2p.dataplane.transport import grpc_core
    from meshnet_p2p.dataplane.transport.connect import ConnectDialog, ConnectError, ConnectHead
    from meshnet_p2p.dataplane.wire import PayloadError, bundle_from_proto, commitment_from_proto
    from meshnet_p2p.dataplane.transport.tls import TlsBindingError, peer_of_der
    from meshnet_p2p.dht import wire
    from meshnet_p2p.nat.dialback import DialbackRejected, dial_target, parse_dial_back, parse_dial_result, verify_dial_result
    from meshnet_p2p.engine.gguf import GGUFFormatError, read_gguf
    from meshnet_p2p.engine.manifest import Manifest, ManifestError
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.records import RecordRejected, RecordVerifier, sign_record
    from meshnet_p2p.trust import verdicts
    from meshnet_p2p.trust.commitment import GENESIS, Commitment, CommitmentError, tokens_digest
    from meshnet_p2p.trust.fraud_proof import ChainLink, FraudProof, FraudProofError

from google.protobuf.message import DecodeError

NOW = 1_800_000_000_000
ME = Identity.from_seed(b"\x32" * 32).peer_id
VERIFIER = RecordVerifier(TYPES)


def datagram(data: bytes) -> None:
    try:
        wire.decode(data, NOW, ME)
    except wire.BadDatagram:
        pass


ALICE = Identity.from_seed(b"\x31" * 32)


def _value(fdp, depth: int = 0):
    pick = fdp.ConsumeIntInRange(0, 6 if depth < 2 else 4)
    if pick == 0:
        return fdp.ConsumeInt(8)
    if pick == 1:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 80))
    if pick == 2:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if pick == 3:
        return fdp.ConsumeBool()
    if pick == 4:
        return None
    if pick == 5:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))}


KINDS = ["ping", "find_node", "find_value", "store", "gossip_push", "gossip_pull", "cookie", "pong", "nodes", "values",
         "dial_back", "dial_result"]


def signed_datagram(data: bytes) -> None:
    """Past the signature, which raw bytes never get through: a body built from
    the input (any msgpack-able shape) in a datagram ALICE signs, decoded as BOB."""
    fdp = atheris.FuzzedDataProvider(data)
    kind = KINDS[fdp.ConsumeIntInRange(0, len(KINDS) - 1)] if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(12)
    body = {fdp.ConsumeUnicodeNoSurrogates(10): _value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 6))}
    try:
        sealed = wire.encode(ALICE, kind, b"\x00" * 8, body, NOW, to=ME)
    except (TypeError, ValueError, OverflowError):  # not encodable: no such datagram can be sent
        return
    try:
        msg = wire.decode(sealed, NOW, ME)
        if "nodes" in msg.body:
            wire.decode_contacts(msg.body["nodes"], 20)
    except wire.BadDatagram:
        pass


def dial_back(data: bytes) -> None:
    """A dial_back body built from the input (mostly of the right shape), in a
    datagram ALICE signs, parsed as a dialer does: the body, then each address."""
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeBool():
        body = {"addrs": [fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 140))
                          for _ in range(fdp.ConsumeIntInRange(0, 5))],
                "nonce": fdp.ConsumeBytes(fdp.ConsumeIntInRange(15, 17))}
    else:
        body = {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))}
    try:
        sealed = wire.encode(ALICE, "dial_back", b"\x00" * 8, body, NOW, to=ME)
    except (TypeError, ValueError, OverflowError):
        return
    try:
        msg = wire.decode(sealed, NOW, ME)
        addrs, _ = parse_dial_back(msg.body)
        for a in addrs:
            dial_target(a, ALICE.peer_id)
    except wire.BadDatagram:
        pass
    try:
        parse_dial_result(body)
    except wire.BadDatagram:
        pass


def dial_result(data: bytes) -> None:
    """Raw bytes as the signed record of a dial_result, checked as an asker does."""
    try:
        verify_dial_result(data, dialer=ALICE.peer_id, subject=ME, nonce=bytes(16), addrs=[], now_ms=NOW)
    except DialbackRejected:
        pass


def record(data: bytes) -> None:
    try:
        VERIFIER.verify(data, NOW, remember=False)
    except RecordRejected:
        pass


def bundle(data: bytes) -> None:
    try:
        bundle_from_proto(pb.TensorBundle.FromString(data))
    except (DecodeError, PayloadError):
        pass


def commitment(data: bytes) -> None:
    """Raw bytes as a step's commitment (Step.upstream, a reply's), completed as its receiver does."""
    try:
        commitment_from_proto(pb.StepCommitment.FromString(data)).complete(
            peer_id=str(ALICE.peer_id), model_digest="ab" * 32, recipe_digest="cd" * 32, route_epoch=0).verifies()
    except (DecodeError, CommitmentError):
        pass


# a report and a verdicts record as ALICE signs them, for the targets that edit them
_CHEAT = Identity.from_seed(b"\x33" * 32)
_MODEL = "ab" * 32


def _signed_proof() -> FraudProof:
    """A transferable proof against _CHEAT at step 2 of a prefill and two decodes."""
    steps, prev, signed = [(0, (1, 2, 3), False), (3, (4,), True), (4, (5,), True)], GENESIS, []
    for i, (position, ids, decode) in enumerate(steps):
        c = Commitment(str(_CHEAT.peer_id), "s-1", _MODEL, "cd" * 32, 0, 10, 0, i, position, decode,
                       tokens_digest(position, ids), bytes([i + 1]) * 32, prev).signed_by(_CHEAT)
        signed.append(c)
        prev = c.link()
    return FraudProof(str(_CHEAT.peer_id), _MODEL, "cd" * 32, 0, 10, 30, "s-1", 2, 4, signed[-1].output_digest.hex(),
                      "ef" * 32, ("r1", "r2"), max_tokens=8, tokens=(1, 2, 3, 4, 5),
                      chain=tuple(ChainLink.of(c) for c in signed[:-1]), commitment=signed[-1])


REPORT = {"key": verdicts.report_key(_MODEL, str(_CHEAT.peer_id)), "reporter": str(ALICE.peer_id),
          "proof": _signed_proof().to_content()}
VERDICTS = {"key": verdicts.verdicts_key(_MODEL, str(ALICE.peer_id)), "certifier": str(ALICE.peer_id),
            "model_digest": _MODEL, "verified": [["p1", 3], ["p2", 1]], "convicted": [[str(_CHEAT.peer_id), "why"]]}
RECORD_VERIFIER = RecordVerifier(verdicts.TYPES)


def _edited(fdp, value):
    """``value`` (a record's content) with the input's edits: at each, walk down to some
    place and replace it with a value the input builds, or drop it."""
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        parent, key = None, None
        at = value
        while isinstance(at, (dict, list)) and at and fdp.ConsumeBool():
            keys = list(at) if isinstance(at, dict) else list(range(len(at)))
            parent, key = at, keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
            at = at[key]
        if parent is None:
            return _value(fdp)
        if fdp.ConsumeIntInRange(0, 3) == 0:
            del parent[key]
        else:
            parent[key] = _value(fdp)
    return value


def _signed_content(data: bytes, kind: str, base: dict) -> None:
    """A record of ``kind`` ALICE signs over ``base`` as the input edits it (or any map the
    input builds), verified as a node does; a report it accepts is read as a re-checker does."""
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeIntInRange(0, 7):
        content = _edited(fdp, copy.deepcopy(base))
    else:
        content = {fdp.ConsumeUnicodeNoSurrogates(10): _value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 6))}
    try:
        wire = sign_record(ALICE, kind, content, seq=1, now_ms=NOW, ttl_ms=60_000)
    except (TypeError, ValueError, OverflowError):  # not encodable: no such record can be sent
        return
    try:
        rec = RECORD_VERIFIER.verify(wire, NOW, remember=False)
    except RecordRejected:
        return
    if kind == verdicts.FRAUD_REPORT:  # accepted: its proof parses, and anyone can re-check it
        try:
            proof = verdicts.proof_of(rec)
            proof.steps()
        except FraudProofError as e:
            raise AssertionError(f"a node accepted a report whose proof does not hold: {e}") from None
        if proof.transferable() is not None:
            raise AssertionError("a node accepted a report of a proof nobody can check")
    else:
        verdicts.verdicts_of([rec], {str(ALICE.peer_id)}, _MODEL)


def report(data: bytes) -> None:
    _signed_content(data, verdicts.FRAUD_REPORT, REPORT)


def peer_verdicts(data: bytes) -> None:
    _signed_content(data, verdicts.PEER_VERDICTS, VERDICTS)


def gguf(data: bytes) -> None:
    try:
        read_gguf("fuzz", buf=b"GGUF" + data)
    except GGUFFormatError:
        pass


def manifest(data: bytes) -> None:
    """Raw bytes as a model's manifest from a peer; one that decodes must check a header too."""
    try:
        m = Manifest.from_bytes(data)
    except ManifestError:
        return
    try:
        m.check_header(data[: m.header_size])
    except ManifestError:
        pass


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def http2(data: bytes) -> None:
    conn = grpc_core.server(max_streams=32)
    conn.initiate()
    try:
        conn.receive_data(PREFACE + data)  # past the preface: frames are what a client controls
        conn.data_to_send()
    except grpc_core.H2ProtocolError:
        pass


def connect(data: bytes) -> None:
    """Raw bytes as a client's CONNECT head to a relay, and as a relay's answer to a client."""
    for feed in (ConnectHead().receive, ConnectDialog("x.peer:443").receive):
        try:
            feed(data)
            feed(b"")
        except ConnectError:
            pass


def certificate(data: bytes) -> None:
    try:
        peer_of_der(data)
    except TlsBindingError:
        pass


TARGETS = {f.__name__: f for f in (datagram, signed_datagram, dial_back, dial_result, record, bundle, commitment,
                                    report, peer_verdicts, gguf, manifest, http2, connect, certificate)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in [*TARGETS, "all"]:
        print(f"usage: {argv[0]} {{{'|'.join(TARGETS)}|all}} [libFuzzer flags]", file=sys.stderr)
        return 2
    names = list(TARGETS) if argv[1] == "all" else [argv[1]]
    if len(names) > 1:  # libFuzzer runs one target per process
        import subprocess

        for name in names:
            print(f"== {name}", flush=True)
            rc = subprocess.call([sys.executable, argv[0], name, *argv[2:]])
            if rc:
                return rc
        return 0
    atheris.Setup([argv[0], *argv[2:]], TARGETS[names[0]])
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
