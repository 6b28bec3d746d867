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
