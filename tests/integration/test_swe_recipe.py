"""`agentrl run --config recipes/swe.yaml` end to end on the tiny model: warm start on the SWE
env's demonstrations, then RL with episodes in real bubblewrap sandboxes, graded by tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl
from tests.unit.envs.sandbox.conftest import needs_bwrap

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_bwrap]


@pytest.fixture
def sandbox_root():
    """A directory for the run's sandboxes that their private uids can traverse (pytest's tmp_path
    is not), checked empty at the end: no sandbox outlives the run."""
    root = Path(tempfile.mkdtemp(prefix="agentrl-swe-recipe-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(600)
def test_swe_recipe_runs_offline_end_to_end(tiny_model: Path, tmp_path: Path, sandbox_root: Path) -> None:
    result = run_agentrl(
        "run", "--config", "recipes/swe.yaml", f"--run_dir={tmp_path / 'run'}",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=2", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=2", "--learner.warmstart.batch_size=2", "--roller.group_size=2",
        "--roller.max_new_tokens=96", f"--roller.task_kwargs={{out_dir: {tmp_path / 'tasks'}}}",
        f"--env.sandbox.root_dir={sandbox_root}", f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=600,
    )  # fmt: skip
    run = tmp_path / "run"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (run / "warmstart" / "model.safetensors").exists()
    assert [r["step"] for r in read_metrics(run / "learner.jsonl")] == [1, 2]
    roller = read_metrics(run / "roller.jsonl")[-1]
    assert roller["roller/groups_failed"] == 0 and roller["roller/groups_put"] >= 4
    assert (run / "hf" / "latest" / "model.safetensors").exists()
    # the tasks were generated under task_kwargs.out_dir, and no sandbox outlived the run
    assert list((tmp_path / "tasks").glob("seed*/tasks.jsonl"))
    assert not list(sandbox_root.iterdir())
