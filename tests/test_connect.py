"""HTTP CONNECT through a relay (dataplane/transport/connect.py): both sans-io ends on h11,
their contract, and properties over any bytes a peer could send."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dataplane.transport.connect import (
    BUSY,
    ESTABLISHED,
    MAX_ANSWER,
    MAX_HEAD,
    ConnectDialog,
    ConnectError,
    ConnectHead,
    relay_target,
    target_peer,
)

PEER = Identity.generate().peer_id


def test_the_target_names_the_peer_and_back():
    target = relay_target(PEER)
    assert target == f"{str(PEER).lower()}.peer:443"
    assert target_peer(target) == str(PEER).lower()
    assert target_peer(target.upper()) == str(PEER).lower()
    assert target_peer("example.com:443") is None and target_peer("") is None


def test_a_dialog_and_a_head_agree_and_hand_over_the_early_bytes():
    dialog, head = ConnectDialog(relay_target(PEER)), ConnectHead()
    assert dialog.request == f"CONNECT {relay_target(PEER)} HTTP/1.1\r\nHost: {relay_target(PEER)}\r\n\r\n".encode()
    assert head.receive(dialog.request[:10]) is None
    assert head.receive(dialog.request[10:] + b"\x16\x03\x01client hello") == relay_target(PEER)
    assert head.early == b"\x16\x03\x01client hello"
    answer = head.answer(ESTABLISHED)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert dialog.receive(answer[:7]) is None
    assert dialog.receive(answer[7:] + b"server hello") == b"server hello"


@pytest.mark.parametrize("status, busy", [(404, False), (BUSY, True), (400, False)])
def test_a_refusal_is_typed_and_429_is_busy(status, busy):
    dialog, head = ConnectDialog(relay_target(PEER)), ConnectHead()
    head.receive(dialog.request)
    with pytest.raises(ConnectError, match=f"the relay refused: HTTP/1.1 {status}") as e:
        dialog.receive(head.answer(status))
    assert (e.value.status, e.value.busy) == (status, busy)


@pytest.mark.parametrize("answer, message", [
    (b"", "closed"),
    (b"garbage" * 2000, "too long"),
    (b"garbage\r\n\r\n", "not HTTP"),
])
def test_a_broken_answer_is_typed(answer, message):
    with pytest.raises(ConnectError, match=message) as e:
        ConnectDialog("x.peer:443").receive(answer)
    assert e.value.status is None and not e.value.busy


@pytest.mark.parametrize("request_bytes, message", [
    (b"CONNECT x.peer:443 HTTP/1.1\r\n\r\n", "Host"),  # HTTP/1.1 requires Host (RFC 9112 3.2)
    (b"CONNECT\r\n\r\n", "not HTTP"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a CONNECT"),
    (b"CONNECT x.peer:443 HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 64 + b"\r\n", "more than 64 headers"),
    (b"CONNECT x.peer:443 HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"y" * MAX_HEAD, "too long"),
    (b"CONNECT x.peer:443 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi", "body"),
])
def test_a_bad_request_head_is_typed(request_bytes, message):
    with pytest.raises(ConnectError, match=message):
        ConnectHead().receive(request_bytes)


def test_a_head_cut_short_is_typed():
    head = ConnectHead()
    assert head.receive(b"CONNECT x.peer:443 HTTP/1.1\r\nHo") is None
    with pytest.raises(ConnectError, match="closed"):
        head.receive(b"")


def test_bare_newlines_are_accepted():
    assert ConnectHead().receive(b"CONNECT x.peer:443 HTTP/1.1\nHost: x\n\n") == "x.peer:443"


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


@given(st.binary(max_size=MAX_HEAD + 200), st.lists(st.integers(0, 10_000), max_size=6))
def test_any_bytes_to_a_head_give_a_target_or_a_typed_error(data, cuts):
    """Whatever a client sends, in whatever pieces: a target, more wanted, or ConnectError;
    never another exception, and never more than the bound buffered."""
    head = ConnectHead()
    try:
        for chunk in _chunks(data, cuts):
            target = head.receive(chunk)
            if target is not None:
                assert isinstance(target, str)
                return
        assert len(data) <= MAX_HEAD  # nothing complete, nothing refused: all of it within the bound
    except ConnectError:
        pass


@given(st.one_of(st.binary(max_size=MAX_ANSWER + 200),
                 st.builds(lambda code, reason, rest: b"HTTP/1.1 %d %s\r\n\r\n" % (code, reason) + rest,
                           st.integers(100, 999), st.binary(max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                           st.binary(max_size=40))),
       st.lists(st.integers(0, 10_000), max_size=6))
@example(b"HTTP/0.0 200\n\n", [])  # CI's random pass, 2026-12-05: h11 reads any HTTP/d.d, and this was spliced
# CI's random pass, 2026-12-07: an answer complete in the first piece, more bytes in the next; the test
# wrongly held the first piece's tail to be all of the data's
@example(b"HTTP/1.0 200 \x01\x01\x01\n\n\x00\x00\x00\x00\x00\x01", [169])
def test_any_relay_answer_gives_the_splice_or_a_typed_error(data, cuts):
    """Whatever a relay answers: the bytes after an HTTP/1.x 200, or ConnectError (a refusal
    carries its status); never another exception."""
    dialog = ConnectDialog("x.peer:443")
    fed = 0
    try:
        for chunk in _chunks(data, cuts) + [b""]:
            early = dialog.receive(chunk)
            fed += len(chunk)
            if early is not None:  # the bytes after the answer among those received so far (the rest come later)
                assert data.startswith(b"HTTP/1.") and data[:fed].endswith(early)
                return
    except ConnectError as e:
        assert e.status is None or (200 <= e.status <= 999 and e.status != ESTABLISHED)
        assert e.busy == (e.status == BUSY)


@given(st.sampled_from([200, 400, 404, 429]), st.binary(max_size=64))
def test_every_answer_the_relay_sends_is_one_the_client_reads(status, early):
    dialog, head = ConnectDialog(relay_target(PEER)), ConnectHead()
    assert head.receive(dialog.request) == relay_target(PEER)
    if status == ESTABLISHED:
        assert dialog.receive(head.answer(status) + early) == early
    else:
        with pytest.raises(ConnectError) as e:
            dialog.receive(head.answer(status) + early)
        assert e.value.status == status
