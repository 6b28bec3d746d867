"""A newcomer's two-tool env under the quickstart's budget, through the real command line:
`agentrl env check`, `agentrl roller` and `agentrl run` refuse it before the first episode,
naming the prompt's length and the fields; with the budget they suggest, a roller against a
real `agentrl serve` and `agentrl queue` generates tokens (and, with no learner, says it waits
for one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.queue import create
from tests.conftest import REPO, find_free_port
from tests.integration.test_weight_sync import wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REFUSAL = re.compile(
    r"the prompt of task '(u\d)' is (\d+) tokens \(chat template with 2 tool\(s\)\), which leaves \d+ of "
    r"roller\.max_total_tokens 256 for a turn of roller\.max_new_tokens 24: no episode can generate a whole "
    r"turn\. Set roller\.max_total_tokens to at least (\d+), e\.g\. --roller\.max_total_tokens (\d+)"
)


def test_a_two_tool_env_over_the_quickstart_budget_is_refused_then_runs_with_the_suggested_one(
    processes, tiny_model: Path, tmp_path: Path
) -> None:
    # a new env file in the directory the user runs from (the unit tests' env, copied)
    (tmp_path / "unit_env.py").write_text((REPO / "tests/unit/envs/unit_env.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO), "AGENTRL_QUEUE_SECRET": "x" * 32, "COLUMNS": "400"}
    common = ["--config", str(REPO / "recipes/quickstart.yaml"), "--env.name=unit_env:UnitConverter",
              "--env.kwargs={}", f"--learner.model_path={tiny_model}", f"--run_dir={tmp_path / 'run'}"]  # fmt: skip

    def agentrl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentrl", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=180)  # fmt: skip

    check = agentrl("env", "check", "unit_env:UnitConverter", *common[2:], "--config", common[1])
    assert check.returncode == 1, check.stdout + check.stderr
    found = REFUSAL.search(check.stdout)
    assert found and "FAIL" in check.stdout and "problems found" in check.stdout, check.stdout
    length, least, suggested = int(found[2]), int(found[3]), int(found[4])
    assert length > 256 and least == length + 24 and suggested >= least

    # nothing listens at these addresses: a roller that got past its check would fail differently
    roller = agentrl("roller", *common, "--queue", "tcp://127.0.0.1:9", "--servers", "http://127.0.0.1:9")
    assert roller.returncode == 2 and "Traceback" not in roller.stderr
    assert REFUSAL.search(roller.stderr)[0] == found[0], roller.stderr
    assert not (tmp_path / "run" / "roller-0.groups").exists()  # no group was ever started

    run = agentrl("run", *common)
    assert run.returncode == 2 and REFUSAL.search(run.stderr)[0] == found[0], run.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no process was started

    # the suggested budget: the roller runs the env against a real server and generates tokens
    http, queue_port = find_free_port(), find_free_port()
    address = f"tcp://127.0.0.1:{queue_port}"
    processes.agentrl("serve", "--model", str(tiny_model), "--port", str(http), env=env)
    processes.agentrl("queue", "--bind", address, f"--run_dir={tmp_path}", "--learner.groups_per_step=1",
                      "--max_staleness=0", env=env)  # fmt: skip
    wait_healthy([f"http://127.0.0.1:{http}"])
    log = tmp_path / "roller.log"
    with log.open("w") as out:
        processes.agentrl("roller", *common, "--queue", address, "--servers", f"http://127.0.0.1:{http}",
                          f"--roller.max_total_tokens={suggested}", "--roller.group_size=2",
                          "--roller.log_every_s=0.5", env=env, cwd=tmp_path, stdout=out, stderr=out)  # fmt: skip
        os.environ["AGENTRL_QUEUE_SECRET"] = env["AGENTRL_QUEUE_SECRET"]
        consumer = create(ZmqQueueConfig(address=address)).consumer("test")
        try:
            batch = consumer.get_batch(1, 0, 0, timeout_s=120)
        finally:
            consumer.close()
        # the queue admits the next group only at version 1: with no learner the roller says it waits
        deadline = time.monotonic() + 60
        while "waiting for the learner" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
    said = log.read_text()
    assert f"prompt budget: longest of 4 prompts {length} tokens, roller.max_total_tokens {suggested}" in said
    assert "waiting for the learner: the queue admits no new group (1 started, learner at version 0)" in said
    episodes = batch.groups[0].episodes
    assert len(episodes) == 2 and all(ep.num_generated > 0 for ep in episodes), [
        ep.finish_reason for ep in episodes
    ]
    assert all(0 < ep.metrics["prompt_tokens"] <= length for ep in episodes)
