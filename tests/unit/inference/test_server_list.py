"""The live server list file (`inference.server_list`): atomic writes, epochs that only move
forward, and a clear error for a file that is not a list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.inference import server_list


def test_reader_returns_each_newer_epoch_once(tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    reader = server_list.Reader(path)
    assert reader.poll() is None  # no file yet
    server_list.write(path, 1, ["http://127.0.0.1:1"])
    assert reader.poll() == server_list.ServerList(1, ("http://127.0.0.1:1",))
    assert reader.poll() is None  # unchanged
    server_list.write(path, 1, ["http://127.0.0.1:9"])  # same epoch: not a change
    server_list.write(path, 0, ["http://127.0.0.1:9"])  # older: never applied
    assert reader.poll() is None
    server_list.write(path, 2, ["http://127.0.0.1:2"])
    assert reader.poll().urls == ("http://127.0.0.1:2",)
    assert [p.name for p in tmp_path.iterdir()] == ["servers.json"]  # no temporary file left


def test_a_broken_file_keeps_the_current_list(tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    server_list.write(path, 3, ["http://127.0.0.1:1"])
    reader = server_list.Reader(path)
    assert reader.poll().epoch == 3
    path.write_text("{not json")
    assert reader.poll() is None and reader.current.epoch == 3
    with pytest.raises(ValueError, match="not a server list"):
        server_list.read(path)
    path.write_text(json.dumps({"epoch": 4, "urls": "http://127.0.0.1:1"}))
    with pytest.raises(ValueError, match="list of URLs"):
        server_list.read(path)
    server_list.write(path, 4, ["http://127.0.0.1:2"])
    assert reader.poll().epoch == 4


def test_the_publisher_hands_each_new_epoch_on_retries_a_failed_send_and_resends(tmp_path: Path) -> None:
    """`Publisher` (a learner on a queue it does not host): a newer epoch is sent at once; a send
    that failed (the queue away) is tried again next round; the current list is sent again every
    `resend_s` (a restarted standalone queue has forgotten it)."""
    import threading

    path = tmp_path / "servers.json"
    sent: list[list] = []
    fail_next = [True]
    got = threading.Condition()

    def send(sl: list) -> None:
        with got:
            if fail_next[0]:
                fail_next[0] = False
                raise ConnectionError("queue away")
            sent.append(sl)
            got.notify_all()

    def until(cond) -> None:
        with got:
            assert got.wait_for(lambda: cond(sent), timeout=30), sent

    server_list.write(path, 1, ["http://127.0.0.1:1"])
    publisher = server_list.Publisher(path, send, every_s=0.02, resend_s=0.3).start()
    try:
        until(lambda s: len(s) >= 1)  # the first send failed; the next round sent it
        assert sent[0] == [1, ["http://127.0.0.1:1"], {}]
        new = [2, ["http://127.0.0.1:2"], {"retriever_url": "http://h:3/retrieve"}]
        server_list.write(path, 2, new[1], new[2])
        until(lambda s: new in s)
        until(lambda s: s.count(new) >= 2)  # sent again with nothing new: the resend
        assert all(sl[0] == 1 for sl in sent[: sent.index(new)]) and sent[-1] == new
    finally:
        publisher.stop()
