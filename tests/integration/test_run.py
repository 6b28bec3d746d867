"""`agentrl run` end to end on the tiny model, checked against the run's own records."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.launch.progress import staleness
from agentrl.log import read_metrics
from tests.conftest import REPO, find_free_port, pid_alive, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.mark.parametrize(("k", "ranks"), [(1, 1), (0, 2)], ids=["k1-one-rank", "k0-two-fsdp-ranks"])
def test_closed_loop_run_keeps_its_invariants(tiny_model: Path, tmp_path: Path, k: int, ranks: int) -> None:
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path}", f"--max_staleness={k}",
        f"--learner.num_processes={ranks}",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=4", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=0", "--roller.group_size=4", "--roller.max_turns=2",
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
    assert queue["refused_auth"] == queue["refused_corrupt"] == queue["dropped_skipped"] == 0
    resolved = (tmp_path / "config.resolved.yaml").read_text()
    assert f"max_staleness: {k}" in resolved
    assert f"learner: {ranks} FSDP2 rank(s)" in (tmp_path / "logs" / "learner.log").read_text()
    assert (tmp_path / "hf" / "latest" / "model.safetensors").exists()
    # the live view's last table ends its line; the state lists no process of the ended run as running
    assert re.search(r"┘\nmetrics: ", result.stdout), result.stdout[-500:]
    state = json.loads((tmp_path / "launcher_state.json").read_text())
    assert state["ended"] and {p["name"]: p["state"] for p in state["processes"]}["learner"] == "exited 0"
    assert not [p for p in state["processes"] if p["state"] == "running"], state["processes"]
    # the learner's transcripts (the first step's sample), rendered by `agentrl show transcripts`
    transcripts = [json.loads(line) for line in (tmp_path / "transcripts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in transcripts] == [1] * 4 and all(t["num_generated"] > 0 for t in transcripts)
    assert all(
        t["turns"][0]["source"] == "prompt" and t["turns"][1]["source"] == "model" for t in transcripts
    )
    shown = run_agentrl("show", "transcripts", str(tmp_path), "--worst", "-n", "1")
    assert shown.returncode == 0 and "[model]" in shown.stdout and "What colour is" in shown.stdout, (
        shown.stderr
    )


def test_a_run_on_redis_trains_and_accounts_for_every_group(
    tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    """`queue.type: redis` under `agentrl run`: the learner writes the admission window (before,
    no roller was ever admitted) and the ledger, so the per-group account holds as on zmq."""
    import yaml

    from agentrl.queue.account import account

    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["queue"] = {"type": "redis", "url": redis_url, "stream": f"test:{tmp_path.name}"}
    config = tmp_path / "redis.yaml"
    config.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", str(config), f"--run_dir={run_dir}", "--max_staleness=0",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=3", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=0", "--roller.group_size=4", "--roller.max_turns=2",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "learner.jsonl")] == [1, 2, 3]
    acct = account(run_dir)
    summary = acct.summary()
    assert acct.put and acct.lost == 0 and acct.duplicated == 0 and acct.leaked_credits == 0, summary
    assert acct.step_residuals and all(r == (0, 0) for r in acct.step_residuals), acct.step_residuals


def _child_pids(output: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", output)}


def test_a_dying_child_stops_the_run_and_is_named(tiny_model: Path, tmp_path: Path) -> None:
    # the roller dies at start-up (its env cannot be built there); the learner and server must go too.
    # The env builds in `agentrl run` itself (its check before starting anything), not in a roller.
    (tmp_path / "broken_env.py").write_text(
        "import os\n\nfrom agentrl.envs import Env\n\n\nclass Broken(Env):\n    def __init__(self):\n"
        "        super().__init__()\n        if 'AGENTRL_ROLLER_INDEX' in os.environ:\n"
        "            raise RuntimeError('broken on purpose')\n\n"
        "    def reset(self, task):\n        return [{'role': 'user', 'content': 'hi'}]\n\n"
        "    @classmethod\n    def generate_tasks(cls, num, seed=0):\n        return [{'id': i} for i in range(num)]\n"
    )
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path / 'run'}",
        f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0",
        "--env.name=broken_env:Broken", "--env.kwargs={}", f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        "--launcher.max_restarts=1", "--launcher.restart_backoff_s=0.2",  # one restart, then it gives up
        timeout=300, env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "roller0 exited with code" in result.stderr
    pids = _child_pids(result.stderr)
    assert {"server0", "learner", "roller0"} <= set(pids)
    assert not any(pid_alive(pid) for pid in pids.values())  # no orphans


def test_sigterm_stops_every_child(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path}",
         f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0", "--learner.max_steps=1000",
         f"--queue.address=tcp://127.0.0.1:{find_free_port()}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "learner.jsonl").exists():  # training has started
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    pids = _child_pids(stderr)
    assert {"server0", "learner", "roller0"} <= set(pids)
    assert not any(pid_alive(pid) for pid in pids.values())
