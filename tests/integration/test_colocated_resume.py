"""A colocated run (`agentrl run`, 2 real gloo ranks) killed after a checkpoint and continued with
`--resume` ends with the same weights, bit for bit, as the same run left alone: the checkpoint
holds the weights, the optimizer states, the version and every replica's task cursor, and
generation is seeded per step and prompt, so the resumed steps sample the same tokens."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import REPO, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 4


def _args(run_dir: Path, model: Path, config: str = "recipes/quickstart_colocated.yaml") -> list[str]:
    # the untrained model earns no reward: the entropy bonus makes every step move the weights
    return ["run", "--config", config, f"--run_dir={run_dir}",
            f"--learner.model_path={model}", "--learner.warmstart.steps=0", f"--learner.max_steps={STEPS}",
            "--learner.checkpoint.every=2", "--learner.loss.entropy_coef=0.05", "--learner.optim.lr=1e-3",
            "--learner.groups_per_step=2", "--roller.group_size=2", "--roller.max_new_tokens=8"]  # fmt: skip


def _kill_after_checkpoint(
    run_dir: Path, model: Path, config: str | None = None, timeout_s: float = 300
) -> None:
    """Start the run (`config`: the recipe, the colocated quickstart's by default) and SIGKILL it
    (its whole process group: launcher, torchrun, ranks) as soon as the checkpoint of version 2 is
    complete (`checkpoints/latest` names it)."""
    args = _args(run_dir, model, config) if config else _args(run_dir, model)
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout_s
    try:
        while not (latest.exists() and latest.read_text().strip() == "step_00000002"):
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint of version 2 within the time limit"
            time.sleep(0.05)
    finally:
        # torchrun starts its ranks in sessions of their own: kill every descendant by PID
        family = [proc.pid, *_descendants(proc.pid)]
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        for pid in family[1:]:
            _wait_gone(pid)


def _descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (children of children, ...), from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _wait_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
        if ") Z " in stat:  # a zombie: dead, waiting for its parent's reaper
            return
        time.sleep(0.05)


def test_colocated_run_killed_and_resumed_equals_uninterrupted(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    result = run_agentrl(*_args(whole, tiny_model), timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]

    _kill_after_checkpoint(cut, tiny_model)
    assert not (cut / "hf").exists()  # killed before the end (the export comes last)
    result = run_agentrl(*_args(cut, tiny_model), "--resume", timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    said = [line for line in result.stderr.splitlines() if "resum" in line or "checkpoint" in line]
    assert any("resumed at version 2" in line for line in said), "\n".join(said)

    a = load_file(whole / "hf" / "latest" / "model.safetensors")
    b = load_file(cut / "hf" / "latest" / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert (value == b[name]).all(), name  # bit-identical
    assert sum(int(not (a[k] == initial[k]).all()) for k in initial if k in a) > 10  # both trained
    # the resumed steps trained on the same tokens with the same losses
    losses = {r["step"]: r["loss"] for r in read_metrics(whole / "learner.jsonl")}
    resumed = {r["step"]: r["loss"] for r in read_metrics(cut / "learner.jsonl")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in (3, 4):
        assert resumed[step] == losses[step], (step, resumed[step], losses[step])
