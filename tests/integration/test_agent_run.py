"""`agentrl run` of recipes/quickstart_agent.yaml: an `openai`-SDK agent trained through the roller's
OpenAI-compatible endpoint, end to end on the tiny model (a few steps; no claim about learning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_the_agent_recipe_trains_on_episodes_its_agent_ran(tiny_model: Path, tmp_path: Path) -> None:
    result = run_agentrl(
        "run", "--config", "recipes/quickstart_agent.yaml", f"--run_dir={tmp_path}",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=3", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=2", "--roller.group_size=4", "--roller.max_concurrent_episodes=16",
        f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "learner.jsonl")] == [1, 2, 3]
    roller_log = (tmp_path / "logs" / "roller0.log").read_text()
    assert "agent endpoint at http://127.0.0.1:" in roller_log
    roller = read_metrics(tmp_path / "roller.jsonl")[-1]
    assert roller["roller/groups_put"] >= 6 and roller["roller/groups_failed"] == 0
    assert roller["roller/version_regressions"] == 0
