"""Bootstrap addresses from flags, the environment and the default list file."""

import pytest

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.node import BootstrapError, bootstrap_addrs, parse_listen, read_bootstrap_list

PID = str(Identity.from_seed(b"\1" * 32).peer_id)
A = f"/ip4/127.0.0.1/udp/4001/p2p/{PID}"
B = f"/ip6/::1/udp/4002/p2p/{PID}"


def test_flags_win_over_the_environment():
    assert [str(a) for a in bootstrap_addrs([A], env={"MESHNET_BOOTSTRAP": B})] == [A]


def test_environment_is_space_or_comma_separated():
    assert [str(a) for a in bootstrap_addrs([], env={"MESHNET_BOOTSTRAP": f"{A}, {B}"})] == [A, B]


@pytest.mark.parametrize(
    "bad",
    [f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}", "/ip4/127.0.0.1/udp/4001", "not-an-address", "/ip4/127.0.0.1/udp/99999/p2p/" + PID],
)
def test_bad_bootstrap_addresses_are_refused(bad):
    with pytest.raises(BootstrapError):
        bootstrap_addrs([bad], env={})


def test_default_list_file_parses_and_is_valid():
    from meshnet_p2p.swarm.node import DEFAULT_LIST

    assert DEFAULT_LIST.exists()
    for text in read_bootstrap_list(DEFAULT_LIST):
        bootstrap_addrs([text], env={})


def test_list_file_format(tmp_path):
    f = tmp_path / "peers.txt"
    f.write_text(f"# comment\n\n{A}  # first\n{B}\n")
    assert read_bootstrap_list(f) == [A, B]


@pytest.mark.parametrize("text,expect", [("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:4001", ("::1", 4001))])
def test_listen_parsing(text, expect):
    assert parse_listen(text) == expect


@pytest.mark.parametrize("text", ["127.0.0.1", ":4001", "host:port", "127.0.0.1:70000"])
def test_bad_listen_is_refused(text):
    with pytest.raises(BootstrapError):
        parse_listen(text)


@pytest.mark.parametrize("listen, seed, expect", [
    ("127.0.0.1", "/ip4/127.0.0.1/udp/4001", "127.0.0.1"),  # a named host is itself
    ("0.0.0.0", "/ip4/127.0.0.1/udp/4001", "127.0.0.1"),  # the address the route to the seed leaves from
    ("::", "/ip6/::1/udp/4001", "::1"),
    # a seed of the other family names an address the (v6-only) socket does not answer at: loopback of its own
    ("0.0.0.0", "/ip6/::1/udp/4001", "127.0.0.1"),
    ("::", "/ip4/127.0.0.1/udp/4001", "::1"),
])
def test_a_wildcard_is_announced_at_an_address_of_its_family(listen, seed, expect):
    from meshnet_p2p.swarm.node import advertised_host

    seed += f"/p2p/{Identity.generate().peer_id}"
    assert advertised_host(listen, [seed]) == expect
