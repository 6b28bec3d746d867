"""`agentrl run` in `mode: colocated`: 2 real gloo ranks generate, reshard, train and export."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import run_agentrl

pytestmark = pytest.mark.slow


def test_colocated_run_trains_on_policy_with_per_phase_metrics(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", "recipes/quickstart_colocated.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0", "--learner.max_steps=2",
        "--learner.groups_per_step=2", "--roller.group_size=2", "--roller.max_new_tokens=8",
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(run_dir / "learner.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["time/generation_s"] > 0 and r["time/reshard_s"] > 0 and r["time/train_s"] > 0
        assert r["reshard/collectives"] > 0  # the all-gathers inside the micro-DP group (dg=2)
        assert r["memory/peak_rss_bytes_rank0"] > 0 and r["memory/peak_rss_bytes_rank1"] > 0
        assert r["staleness/max"] == 0  # generated at version v, trained at version v
        assert r["groups_consumed"] > 0
    assert (run_dir / "hf" / "latest" / "config.json").exists()
