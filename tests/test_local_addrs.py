"""Where a wildcard listen is printed as dialable: one address per local address,
loopback last, never 0.0.0.0 or :: (core/local_addrs.py)."""

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.local_addrs import interface_hosts, listen_hosts, listen_multiaddrs, listen_urls, order_hosts

FOUND = ["127.0.0.1", "::1", "192.0.2.2", "fd00::2", "fe80::fc:ff:fe00:1%eth0", "10.1.2.3", "192.0.2.2", "garbage"]


def test_a_wildcard_names_each_local_address_of_its_family_loopback_last():
    assert order_hosts("0.0.0.0", FOUND) == ["192.0.2.2", "10.1.2.3", "127.0.0.1"]
    # link-local IPv6 needs a zone a multiaddr cannot carry: left out
    assert order_hosts("::", FOUND) == ["fd00::2", "::1"]


def test_with_no_address_found_loopback_is_named():
    assert order_hosts("0.0.0.0", []) == ["127.0.0.1"]
    assert order_hosts("::", ["127.0.0.1"]) == ["::1"]


def test_a_named_host_is_itself():
    assert listen_hosts("127.0.0.1") == ["127.0.0.1"]
    assert listen_hosts("::1", found=FOUND) == ["::1"]
    assert listen_urls("127.0.0.1", "http://127.0.0.1:8000") == ["http://127.0.0.1:8000"]


def test_multiaddrs_and_urls_of_a_wildcard():
    peer = Identity.generate().peer_id
    assert [str(a) for a in listen_multiaddrs("0.0.0.0", "udp", 4001, peer, found=FOUND)] == [
        f"/ip4/192.0.2.2/udp/4001/p2p/{peer}", f"/ip4/10.1.2.3/udp/4001/p2p/{peer}", f"/ip4/127.0.0.1/udp/4001/p2p/{peer}"]
    assert listen_urls("::", "http://[::]:8080", found=FOUND) == ["http://[fd00::2]:8080", "http://[::1]:8080"]


def test_this_machine_lists_its_loopback():
    assert "127.0.0.1" in interface_hosts()  # lo is up wherever the tests run
    assert listen_hosts("0.0.0.0")[-1] == "127.0.0.1"


ips = st.one_of(st.ip_addresses().map(str), st.text(max_size=12))


@given(st.sampled_from(["0.0.0.0", "::", ""]), st.lists(ips, max_size=12))
def test_a_wildcard_is_never_printed_and_loopback_comes_last(wildcard, found):
    hosts = order_hosts(wildcard, found)
    parsed = [ipaddress.ip_address(h) for h in hosts]
    assert hosts and len(set(hosts)) == len(hosts)
    assert all(not ip.is_unspecified and ip.version == (6 if ":" in wildcard else 4) for ip in parsed)
    loop = [ip.is_loopback for ip in parsed]
    assert loop == sorted(loop)  # every non-loopback address before every loopback one
