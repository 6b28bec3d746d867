"""`agentrl learner` end to end: a real process hosting the ZeroMQ TransferQueue, fed by a real
producer from the test; it trains, writes metrics, a resumable checkpoint and a loadable HF
export, exits cleanly, and `--resume` continues the version numbering. On a full disk (a small
tmpfs in a private mount namespace) the checkpoint's ENOSPC is the error it exits with."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.log import read_metrics
from tests.conftest import require_private_mounts
from tests.unit.learner.source import make_groups

SECRET = {"AGENTRL_QUEUE_SECRET": "test-secret-for-the-learner-cli"}


async def _put(address: str, groups) -> None:
    from agentrl.queue import create

    os.environ.update(SECRET)
    # the learner may take longer than the default 30 s to bind on a loaded machine
    producer = create(ZmqQueueConfig(address=address, connect_timeout_s=180)).producer()
    try:
        for g in groups:
            await asyncio.wait_for(producer.put(g), timeout=60)
    finally:
        producer.close()


def _learner(processes, tiny_model, run_dir, address, max_steps, *extra, wrap=None):
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
    command = [sys.executable, "-m", "agentrl", "learner", *args, *extra]
    return processes.start(wrap(command) if wrap else command, env=env)


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


@pytest.mark.slow
@pytest.mark.integration
def test_a_full_disk_at_a_checkpoint_is_the_error_the_learner_exits_with(
    processes, tiny_model, tmp_path, free_port
):
    unshare = require_private_mounts()
    run_dir, listing = tmp_path / "run", tmp_path / "listing"
    run_dir.mkdir()

    def on_small_tmpfs(command):  # room for the run's small files, not for one checkpoint
        learner = " ".join(map(shlex.quote, command))
        script = (f"mount -t tmpfs -o size=384k tmpfs {run_dir} && {{ {learner}; code=$?; "
                  f"ls -a {run_dir}/checkpoints > {listing}; exit $code; }}")  # fmt: skip
        return [unshare, "--mount", "--propagation", "private", "sh", "-c", script]

    address = f"tcp://127.0.0.1:{free_port}"
    proc = _learner(processes, tiny_model, run_dir, address, 2, "--learner.checkpoint.every=1",
                    wrap=on_small_tmpfs)  # fmt: skip
    asyncio.run(_put(address, make_groups(2, seed=23)))
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if " E agentrl" in line]
    assert errors and "No space left on device" in errors[0] and "step_00000001" in errors[0], err[-3000:]
    assert "Traceback" not in err  # the first error is the message, not masked by a later one
    assert "partial-" not in listing.read_text()
