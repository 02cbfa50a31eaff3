"""Bad values of verified compute's flags (docs/verification.md): `generate
--verify/--audit-rate` and `audit --peer` are refused by the parser with one
clear line and exit 2, before any network work (no swarm here: the bootstrap
address below answers nothing, so reaching the network would fail otherwise)."""

import pytest

from meshnet_p2p.core.identity import Identity

from tests.swarm import meshnet_peer

NOBODY = f"/ip4/127.0.0.1/udp/9/p2p/{Identity.from_seed(b'1' * 32).peer_id}"  # the discard port: no peer there


def _refused(r, needle: str) -> None:
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert needle in last and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--verify", "bogus"], "argument --verify: invalid choice: 'bogus'"),
    (["--audit-rate", "2"], "argument --audit-rate: '2' must be between 0 and 1"),
    (["--audit-rate", "-0.1"], "must be between 0 and 1"),
    (["--audit-rate", "nan"], "must be between 0 and 1"),
    (["--audit-rate", "x"], "argument --audit-rate: 'x' is not a number"),
])
def test_generate_refuses_a_bad_verify_mode_or_audit_rate(args, needle):
    _refused(meshnet_peer("generate", "--bootstrap", NOBODY, "--prompt", "hi", *args, timeout=60), needle)


@pytest.mark.parametrize("peer", ["not-a-peer", "", "12D3KooW", str(Identity.from_seed(b"2" * 32).peer_id)[:-1] + "!"])
def test_audit_refuses_a_malformed_peer_id_before_any_network_work(peer):
    _refused(meshnet_peer("audit", "--bootstrap", NOBODY, "--peer", peer, timeout=60), "argument --peer:")
