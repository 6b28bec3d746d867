"""`agentrl run` end to end on the tiny model, checked against the run's own records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.launcher import staleness
from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_closed_loop_run_keeps_its_invariants(tiny_model: Path, tmp_path: Path) -> None:
    k = 1
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path}", f"--max_staleness={k}",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=4", "--learner.groups_per_step=2",
        "--learner.warmstart_steps=0", "--roller.group_size=4", "--roller.max_turns=2",
        "--roller.max_concurrent_episodes=16", f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"plot:    {tmp_path / 'reward_staleness.png'}" in result.stdout
    assert (tmp_path / "reward_staleness.png").stat().st_size > 0

    learner = read_metrics(tmp_path / "learner.jsonl")
    assert [r["step"] for r in learner] == [1, 2, 3, 4]
    for record in learner:
        _, worst = staleness(record)
        assert worst is not None and worst <= k  # no group trained on with staleness > k
        assert record["sync/servers_updated"] == 1 and record["sync/servers_dropped"] == 0
    roller = read_metrics(tmp_path / "roller.jsonl")[-1]
    assert roller["roller/version_regressions"] == 0  # versions seen by rollers only increase
    # every group produced is trained on, dropped for staleness (counted) or still queued at the end
    queue = json.loads((tmp_path / "queue_final.json").read_text())
    assert roller["roller/groups_put"] == queue["groups_in"]
    trained = learner[-1]["groups_consumed"]
    assert queue["groups_in"] == trained + queue["dropped_stale"] + queue["depth"] + queue["inflight"]
    assert queue["refused_auth"] == queue["refused_corrupt"] == 0
    resolved = (tmp_path / "config.resolved.yaml").read_text()
    assert f"max_staleness: {k}" in resolved
    assert (tmp_path / "hf" / "latest" / "model.safetensors").exists()
