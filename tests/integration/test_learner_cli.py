"""`agentrl learner` end to end: a real process hosting the ZeroMQ TransferQueue, fed by a real
producer from the test; it trains, writes metrics, a resumable checkpoint and a loadable HF
export, exits cleanly, and `--resume` continues the version numbering."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.log import read_metrics
from tests.unit.learner.source import make_groups

SECRET = {"AGENTRL_QUEUE_SECRET": "test-secret-for-the-learner-cli"}


async def _put(address: str, groups) -> None:
    from agentrl.queue.base import create

    os.environ.update(SECRET)
    # the learner may take longer than the default 30 s to bind on a loaded machine
    producer = create(ZmqQueueConfig(address=address, connect_timeout_s=180)).producer()
    try:
        for g in groups:
            await asyncio.wait_for(producer.put(g), timeout=60)
    finally:
        producer.close()


def _learner(processes, tiny_model, run_dir, address, max_steps, *extra):
    overrides = {
        "run_dir": run_dir,
        "learner.model_path": tiny_model,
        "learner.max_steps": max_steps,
        "learner.groups_per_step": 2,
        "learner.optim.lr": 1e-3,
        "learner.batch_timeout_s": 0.5,
        "queue.address": address,
    }
    args = [f"--{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, **SECRET, "OMP_NUM_THREADS": "1"}
    return processes.start([sys.executable, "-m", "agentrl", "learner", *args, *extra], env=env)


@pytest.mark.slow
@pytest.mark.integration
def test_learner_cli_trains_from_the_queue_and_resumes(processes, tiny_model, tmp_path, free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    proc = _learner(processes, tiny_model, tmp_path, address, 2)
    asyncio.run(_put(address, make_groups(4, seed=21)))
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err.decode()[-3000:]
    rows = read_metrics(tmp_path / "learner.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "config.resolved.yaml").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    proc = _learner(processes, tiny_model, tmp_path, address, 3, "--resume")
    asyncio.run(_put(address, make_groups(2, seed=22, version=2)))  # fresh at version 2
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "resumed from" in err.decode()
    assert [r["step"] for r in read_metrics(tmp_path / "learner.jsonl")] == [1, 2, 3]

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "latest")
