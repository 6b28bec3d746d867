"""Unauthenticated, corrupt and oversized messages are refused and counted; the server keeps serving."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from agentrl.queue import auth as auth_module
from agentrl.queue.auth import AESGCM, Authenticator, AuthError, Poly1305, load_secret
from agentrl.queue.frames import pack
from agentrl.wire import encode_group
from tests.unit.queue.conftest import SECRET, Harness, make_group

pytestmark = pytest.mark.timeout(90)  # a hang fails this test, not the whole run


@pytest.mark.parametrize("scheme", ["G", "P", "H"])
def test_mac_covers_control_payload_and_framing(scheme: str) -> None:
    if (scheme == "P" and Poly1305 is None) or (scheme == "G" and AESGCM is None):
        pytest.skip("this MAC needs the `cryptography` package")
    auth = Authenticator(SECRET.encode(), scheme)
    control, payload = b"ctl", [b"abc", b"def"]
    mac = auth.sign(control, payload)
    auth.verify(mac, control, payload)
    for bad_control, bad_payload in [
        (b"ctX", payload),
        (control, [b"abc", b"deX"]),
        (control, [b"ab", b"cdef"]),
    ]:
        with pytest.raises(AuthError):
            auth.verify(mac, bad_control, bad_payload)
    with pytest.raises(AuthError):
        Authenticator(b"another-secret-of-some-length").verify(mac, control, payload)
    with pytest.raises(AuthError):
        auth.verify(b"-", control, payload)


def test_gmac_chunks_frames_and_binds_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    if AESGCM is None:
        pytest.skip("GMAC needs the `cryptography` package")
    monkeypatch.setattr(auth_module, "GMAC_CHUNK", 4)  # frames of several chunks, one partial
    auth = Authenticator(SECRET.encode(), "G")
    control, payload = b"ctl", [b"0123456789", b"", b"abcd"]
    mac = auth.sign(control, payload)
    auth.verify(mac, control, payload)
    for bad in ([b"0123456788", b"", b"abcd"], [b"0123456789", b"a", b"bcd"], [b"0123456789", b"abcd"]):
        with pytest.raises(AuthError):
            auth.verify(mac, control, bad)


def test_a_receiver_accepts_every_scheme_and_senders_use_the_fastest() -> None:
    receiver = Authenticator(SECRET.encode())
    assert receiver.scheme == ("G" if AESGCM is not None else "P" if Poly1305 is not None else "H")
    schemes = ["H"] + (["P"] if Poly1305 is not None else []) + (["G"] if AESGCM is not None else [])
    for scheme in schemes:
        mac = Authenticator(SECRET.encode(), scheme).sign(b"ctl", [b"payload"])
        assert mac[:1] == scheme.encode()
        receiver.verify(mac, b"ctl", [b"payload"])


def test_missing_secret_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTRL_QUEUE_SECRET", raising=False)
    with pytest.raises(AuthError, match="AGENTRL_QUEUE_SECRET"):
        load_secret("AGENTRL_QUEUE_SECRET")


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _put(auth: Authenticator, rid: int, gid: str, frames: list[bytes], tamper: bool = False) -> list[bytes]:
    """A put message as a producer builds it (see zmq_producer / frames.pack)."""
    return _put_many(auth, [(rid, gid, frames)], tamper)


def _put_many(
    auth: Authenticator, puts: list[tuple[int, str, list[bytes]]], tamper: bool = False
) -> list[bytes]:
    """One put message carrying several groups, as the producer coalesces them."""
    frames = [f for _, _, group_frames in puts for f in group_frames]
    items = [[rid, gid, len(group_frames)] for rid, gid, group_frames in puts]
    lens, counts, segments = pack(frames)
    control = msgpack.packb({"k": "put", "items": items, "lens": lens, "segs": counts})
    segments = [bytes(s) for s in segments]
    mac = auth.sign(control, segments)
    if tamper:  # the payload changes after signing
        segments[-1] = segments[-1][:-1] + b"\xff"
    return [mac, control, *segments]


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_unauthenticated_and_corrupt_messages_are_refused(zmq_queue: Harness) -> None:
    zmq_queue.start(max_message_bytes=1 << 16)
    server = zmq_queue.server
    ctx, sock = _raw_dealer(zmq_queue.address)
    group = make_group(seed=1)
    frames = [bytes(f) for f in encode_group(group)]
    wrong = Authenticator(b"not-the-secret-but-long-enough")
    right = Authenticator(SECRET.encode())
    signed = _put(right, 1, group.group_id, frames)
    sock.send_multipart([b"-", *signed[1:]])  # unsigned
    sock.send_multipart(_put(wrong, 1, group.group_id, frames))  # wrong secret
    sock.send_multipart(_put(right, 1, group.group_id, frames, tamper=True))
    sock.send_multipart([b"x"])  # too few frames
    assert _wait_for(
        lambda: server.metrics()["refused_auth"] == 3 and server.metrics()["refused_corrupt"] == 1
    )
    assert not sock.poll(300), "an unauthenticated peer got an answer"

    garbage = b"\xc1 not msgpack"
    sock.send_multipart([right.sign(garbage), garbage])
    bad_group = [frames[0], frames[1][:-4], *frames[2:]]  # signed, but the tokens frame is cut short
    sock.send_multipart(_put(right, 2, group.group_id, bad_group))
    big = make_group(seed=2, tokens=8192)
    sock.send_multipart(_put(right, 3, big.group_id, [bytes(f) for f in encode_group(big)]))
    assert _wait_for(
        lambda: server.metrics()["refused_corrupt"] == 3 and server.metrics()["refused_oversize"] == 1
    )
    replies = []
    while sock.poll(1000) and len(replies) < 3:
        mac, control = sock.recv_multipart()
        right.verify(mac, control)
        replies.append(msgpack.unpackb(control))
    assert [r["k"] for r in replies] == ["err"] * 3
    assert "max_message_bytes" in replies[2]["msg"]
    sock.close()
    ctx.term()

    zmq_queue.put([group])  # and the server still serves honest peers
    batch = zmq_queue.consumer().get_batch(1, 0, 1, timeout_s=10)
    assert batch.group_ids == [group.group_id]
    assert server.metrics()["groups_in"] == 1


def test_a_bad_group_in_a_coalesced_put_is_refused_alone(zmq_queue: Harness) -> None:
    """Groups of one message are decoded together; one corrupt group (or one sent twice) must
    not take its neighbours down with it."""
    zmq_queue.start()
    ctx, sock = _raw_dealer(zmq_queue.address)
    right = Authenticator(SECRET.encode())
    good = [make_group(seed=i) for i in range(3)]
    frames = [[bytes(f) for f in encode_group(g)] for g in good]
    bad = make_group(seed=9)
    bad_frames = [bytes(f) for f in encode_group(bad)]
    bad_frames[2] = b"\x07" + bad_frames[2][1:]  # a loss_mask of 7
    puts = [(1, good[0].group_id, frames[0]), (2, bad.group_id, bad_frames), (3, good[1].group_id, frames[1])]
    puts += [(4, good[0].group_id, frames[0]), (5, good[2].group_id, frames[2])]
    sock.send_multipart(_put_many(right, puts))
    answers: dict[int, str] = {}
    while len(answers) < 5 and sock.poll(5000):
        mac, control = sock.recv_multipart()
        right.verify(mac, control)
        reply = msgpack.unpackb(control)
        answers.update({rid: reply["k"] for rid in reply.get("rids", [reply.get("rid")])})
        if reply["k"] == "err":
            assert "episodes[0].loss_mask: values must be 0 or 1" in reply["msg"]
    sock.close()
    ctx.term()
    assert answers == {1: "ok", 2: "err", 3: "ok", 4: "ok", 5: "ok"}
    metrics = zmq_queue.server.metrics()
    assert (metrics["groups_in"], metrics["duplicates"], metrics["refused_corrupt"]) == (3, 1, 1)
    batch = zmq_queue.consumer().get_batch(3, 0, 1, timeout_s=10)
    assert sorted(batch.group_ids) == sorted(g.group_id for g in good)


def test_in_process_consumer_uses_inproc(zmq_queue: Harness) -> None:
    zmq_queue.start()
    groups = [make_group(seed=i) for i in range(3)]
    zmq_queue.put(groups, concurrent=True)
    consumer = zmq_queue.backend.consumer("rank0", server=zmq_queue.server)
    try:
        batch = consumer.get_batch(3, 0, 1, timeout_s=10)
        assert sorted(batch.group_ids) == sorted(g.group_id for g in groups)
        consumer.ack(batch.group_ids)
        assert consumer.metrics()["bytes"] == 0
    finally:
        consumer.close()
