"""`DiskEngine` following the launcher's live server list (`inference.server_list`), with two real
embedded servers (in-process, tests/unit/inference/conftest.py's `ServerThread`): a server added
to the list is behind until it loads the version on disk (the catch-up push, no new write); one
removed from it is not pushed the next version."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agentrl.config import DiskSyncConfig, InferenceConfig
from agentrl.inference import server_list
from agentrl.weight_sync.registry import create
from tests.unit.inference.conftest import ServerThread


def test_disk_engine_follows_the_live_list(tiny_model: Path, tmp_path: Path) -> None:
    first, second = ServerThread(tiny_model).start(), ServerThread(tiny_model).start()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    path = tmp_path / "servers.json"
    server_list.write(path, 1, [first.url])
    engine = create(
        DiskSyncConfig(directory=str(tmp_path / "weights")),
        InferenceConfig(type="sglang", servers=[first.url]),
        servers_file=path,
    )
    engine.init()
    try:
        assert engine.push(model.named_parameters, 1).servers_updated == 1
        server_list.write(path, 2, [first.url, second.url])
        deadline = time.monotonic() + 30  # the next probe round sees the new server
        while (late := engine.behind(1)) != [second.url]:
            assert time.monotonic() < deadline, late
            time.sleep(0.1)
        assert engine.push(model.named_parameters, 1).servers_updated == 1  # it loads v1 from disk
        assert str(second.engine.weight_version) == "1"
        server_list.write(path, 3, [second.url])
        stats = engine.push(model.named_parameters, 2)
        assert stats.servers_updated == 1 and stats.servers_dropped == [] and engine.urls == [second.url]
        assert (str(first.engine.weight_version), str(second.engine.weight_version)) == ("1", "2")
    finally:
        engine.close()
        first.stop()
        second.stop()
