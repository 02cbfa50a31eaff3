"""Identities, peer IDs, key files and multiaddrs."""

import json
import os
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.core.identity import (
    Identity,
    IdentityError,
    KeyFileError,
    PeerId,
    b58decode,
    b58encode,
    encode_public_key,
)
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError

from tests.swarm import meshnet_peer

VECTORS = json.loads((pathlib.Path(__file__).parent.parent / "identity" / "vectors.json").read_text())


@pytest.mark.parametrize("v", VECTORS["ed25519"])
def test_conformance_vectors(v):
    ident = Identity.from_protobuf(bytes.fromhex(v["private_key_protobuf_hex"]))
    assert encode_public_key(ident.public_key_bytes).hex() == v["public_key_protobuf_hex"]
    assert str(ident.peer_id) == v["peer_id"]
    assert PeerId.from_string(v["peer_id"]) == ident.peer_id
    assert ident.to_protobuf().hex() == v["private_key_protobuf_hex"]


@pytest.mark.parametrize("v", VECTORS["invalid_peer_ids"], ids=lambda v: v["why"])
def test_invalid_peer_ids_are_refused(v):
    with pytest.raises(IdentityError):
        PeerId.from_string(v["text"])


def test_signatures_verify_against_the_peer_id_alone():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    pid = PeerId.from_string(str(a.peer_id))
    assert pid.verify(sig, b"hello")
    assert not pid.verify(sig, b"hellO")
    assert not b.peer_id.verify(sig, b"hello")
    assert not pid.verify(b"\0" * 64, b"hello")
    assert str(a.peer_id).startswith("12D3KooW") and len(str(a.peer_id)) == 52


@given(st.binary(max_size=60))
def test_base58_round_trips(data):
    assert b58decode(b58encode(data)) == data


@given(st.text(max_size=80))
def test_fuzz_peer_id_parser_only_raises_identity_errors(text):
    try:
        PeerId.from_string(text)
    except IdentityError:
        pass


def test_mismatched_private_key_encoding_is_refused():
    good = Identity.generate().to_protobuf()
    other = Identity.generate().public_key_bytes
    with pytest.raises(IdentityError, match="does not match"):
        Identity.from_protobuf(good[:36] + other)


def test_key_files_are_0600_and_unsafe_ones_refused(tmp_path):
    path = str(tmp_path / "sub" / "id.key")
    ident = Identity.generate()
    ident.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert Identity.load(path).peer_id == ident.peer_id
    with pytest.raises(KeyFileError, match="already exists"):
        Identity.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="readable by others"):
        Identity.load(path)
    os.chmod(path, 0o600)
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(KeyFileError):
        Identity.load(path)
    with pytest.raises(KeyFileError, match="no identity"):
        Identity.load(str(tmp_path / "missing.key"))


PID = VECTORS["ed25519"][0]["peer_id"]


@pytest.mark.parametrize(
    "text,host,port,transport",
    [
        (f"/ip4/127.0.0.1/udp/4001/p2p/{PID}", "127.0.0.1", 4001, "udp"),
        (f"/ip4/10.0.0.2/tcp/4001/p2p/{PID}", "10.0.0.2", 4001, "tcp"),
        (f"/ip6/::1/udp/0/p2p/{PID}", "::1", 0, "udp"),
        (f"/dns4/boot.example.org/tcp/443/p2p/{PID}", "boot.example.org", 443, "tcp"),
        ("/ip4/127.0.0.1/tcp/9000", "127.0.0.1", 9000, "tcp"),
    ],
)
def test_multiaddrs_parse_and_print_back(text, host, port, transport):
    m = Multiaddr.parse(text)
    assert (m.host, m.port, m.transport) == (host, port, transport)
    assert str(m) == text
    if "/p2p/" in text:
        assert str(m.peer_id) == PID


@pytest.mark.parametrize(
    "text",
    [
        "ip4/127.0.0.1/udp/1",
        "/ip4/300.0.0.1/udp/1",
        "/ip4/127.0.0.1/udp/70000",
        "/ip4/127.0.0.1/udp/",
        "/ip4/127.0.0.1/udp/01",
        "/ip4/127.0.0.1/quic/1",
        "/dns4/bad_name!/tcp/1",
        "/ip4/127.0.0.1/udp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        "/ip4/127.0.0.1/udp/1/tcp/2",
        "/",
    ],
)
def test_bad_multiaddrs_are_refused(text):
    with pytest.raises(MultiaddrError):
        Multiaddr.parse(text)


@given(st.text(alphabet="/abcdefgiptu0123456789.:-KDW", max_size=80))
def test_fuzz_multiaddr_parser_only_raises_multiaddr_errors(text):
    try:
        Multiaddr.parse(text)
    except MultiaddrError:
        pass


def test_cli_identity_new_and_show(tmp_path):
    path = str(tmp_path / "id.key")
    r = meshnet_peer("identity", "new", "--identity", path)
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    assert new["peer_id"].startswith("12D3KooW")
    assert os.stat(path).st_mode & 0o777 == 0o600
    r = meshnet_peer("identity", "show", "--identity", path)
    assert json.loads(r.stdout)["peer_id"] == new["peer_id"]
    r = meshnet_peer("identity", "new", "--identity", path)
    assert r.returncode == 2 and "already exists" in r.stderr
    os.chmod(path, 0o640)
    r = meshnet_peer("identity", "show", "--identity", path)
    assert r.returncode == 2 and "chmod 600" in r.stderr and "Traceback" not in r.stderr
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    r = meshnet_peer("identity", "new", env=env)
    assert r.returncode == 0 and (tmp_path / "cfg" / "meshnet-p2p" / "identity.key").exists()


def test_a_peer_role_keeps_the_machines_identity_across_restarts_and_one_process_holds_it(tmp_path):
    """Issue 60: `bootstrap`, `relay` and `join` without --identity are the machine's peer (its
    default key file, created 0600 on first use), so a restart is the same peer; a second one
    on the same key while the first runs is refused with what to do; a throwaway identity only
    on request."""
    import subprocess
    import sys

    from meshnet_p2p.roles.peer_process import OutputLines

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    key = tmp_path / "cfg" / "meshnet-p2p" / "identity.key"
    seen = []

    def bootstrap(*extra):
        return OutputLines(subprocess.Popen([sys.executable, "-m", "meshnet_p2p", "bootstrap", "--listen",
                                             "127.0.0.1:0", *extra], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True, env=env))

    def stop(p):
        p.p.terminate()
        return p.p.wait(timeout=60)

    first = bootstrap()
    try:
        seen.append(first.wait_line("identity ", 60))
        assert f"(created {key})" in seen[0] and os.stat(key).st_mode & 0o777 == 0o600
        second = subprocess.run([sys.executable, "-m", "meshnet_p2p", "bootstrap", "--listen", "127.0.0.1:0"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert second.returncode == 2 and "in use by another running peer" in second.stderr, second.stderr
        assert "--ephemeral-identity" in second.stderr and "Traceback" not in second.stderr
        throwaway = bootstrap("--ephemeral-identity")
        try:
            line = throwaway.wait_line("identity ", 60)
            assert "ephemeral" in line and line.split()[1] != seen[0].split()[1]
        finally:
            stop(throwaway)
    finally:
        assert stop(first) == 0
    again = bootstrap()
    try:
        seen.append(again.wait_line("identity ", 60))
    finally:
        stop(again)
    assert seen[1] == f"identity {seen[0].split()[1]} ({key})", seen  # the same peer, its key not made again
    both = subprocess.run([sys.executable, "-m", "meshnet_p2p", "bootstrap", "--identity", str(key),
                           "--ephemeral-identity"], capture_output=True, text=True, env=env, timeout=60)
    assert both.returncode == 2 and "give one" in both.stderr


def test_a_restarted_volunteer_is_the_same_peer_and_certify_signs_with_the_machines_key(tmp_path):
    """Issue 60: `join` with no --identity, stopped and started again, serves as the same peer
    ID (so every client's record of it still applies); `certify` with no --identity signs with
    that same machine key (and says so), not a fresh one."""
    from meshnet_p2p.roles.peer_process import PeerProcess
    from tests.swarm import Proc

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "MESHNET_CACHE_DIR": str(tmp_path / "cache")}
    boot = Proc("bootstrap", "--listen", "127.0.0.1:0", env=env)  # a throwaway peer (PeerProcess's default)
    try:
        addr = boot.address(60)
        seen = []
        for _ in range(2):  # as a volunteer runs it: no identity flag at all
            join = PeerProcess("join", "--layers", "0:10", "--bootstrap", addr, "--listen", "127.0.0.1:0",
                               "--threads", "1", env=env, machine_key=True)
            try:
                seen.append((join.wait_line("identity ", 120), join.address(120).rsplit("/", 1)[1]))
            finally:
                assert join.stop() == 0
        (first_line, first), (second_line, second) = seen
        assert first == second and "created" in first_line and "created" not in second_line, seen
        assert first_line.split()[1] == first
        r = meshnet_peer("certify", "--bootstrap", addr, "--json", env=env, timeout=120)  # (no recipe to certify)
        assert f"signing as {first}" in r.stderr, r.stderr[-2000:]
    finally:
        boot.stop()
