"""`agentrl scale --servers 2` on a running 1-server `agentrl run` (the local launcher): the new
server starts on a new port, joins the live server list once healthy (`inference.server_list`),
the learner brings it to the current weights (its catch-up push, then every push reaches both),
the roller's router learns it from the queue's replies and sends it generations, and the run's
per-group account stays 0 lost / 0 trained twice / 0 credits leaked; then `--servers 1` takes it
off the list again and later pushes reach the one left."""

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

from agentrl.log import read_metrics
from tests.conftest import REPO, find_free_port, pid_alive
from tests.integration.test_faults_servers import _pids, _steps, assert_account

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(400)]


def _scale(run_dir: Path, servers: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "agentrl", "scale", "--run-dir", str(run_dir), "--servers", str(servers)],
        cwd=REPO, check=True, timeout=120,
    )  # fmt: skip


def _wait(what: str, cond, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, log.read_text(errors="replace")[-6000:]
        assert time.monotonic() < deadline, (
            f"{what}: not within {timeout_s}s\n" + log.read_text(errors="replace")[-6000:]
        )
        time.sleep(0.3)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_scale_servers_up_and_down_under_agentrl_run(tiny_model: Path, tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
             "--max_staleness=1", f"--learner.model_path={tiny_model}", "--learner.max_steps=1000",
             "--learner.groups_per_step=4", "--learner.warmstart.steps=0", "--learner.batch_timeout_s=1",
             "--roller.group_size=4", "--roller.max_turns=2", "--roller.max_concurrent_episodes=16",
             "--inference.health_check_interval_s=1", "--launcher.restart_backoff_s=0.5",
             f"--queue.address=tcp://127.0.0.1:{find_free_port()}"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait("training started", lambda: len(_steps(run_dir)) >= 2, proc, log)
        assert json.loads((run_dir / "servers.json").read_text())["epoch"] == 1
        _scale(run_dir, 2)
        _wait("server1 on the list", lambda: json.loads((run_dir / "servers.json").read_text())["epoch"] == 2,
              proc, log)  # fmt: skip
        listed = json.loads((run_dir / "servers.json").read_text())
        assert len(listed["urls"]) == 2
        new = listed["urls"][1]
        learner_log, roller_log = run_dir / "logs" / "learner.log", run_dir / "logs" / "roller0.log"
        at_add = len(_steps(run_dir))

        def both_in_use() -> bool:
            records = read_metrics(run_dir / "learner.jsonl")[at_add:]
            return any(
                r["sync/servers_updated"] == 2 for r in records
            ) and f"server {new} served its first request" in _text(roller_log)

        _wait("the new server in the weight group and serving the roller", both_in_use, proc, log)
        text = _text(learner_log)
        assert f"servers ['{new}'] added to the server list" in text, text[-4000:]
        assert re.search(r"are behind version \d+: pushing the current weights now", text) or re.search(
            rf"servers \['{new}'\] added: rebuilding the weight group", text
        ), text[-4000:]
        assert not re.search(rf"servers \['{new}'\] are up again", text), text[-4000:]  # it was never down
        _scale(run_dir, 1)
        _wait("server1 off the list", lambda: json.loads((run_dir / "servers.json").read_text())["epoch"] == 3,
              proc, log)  # fmt: skip
        at_remove = len(_steps(run_dir))
        _wait("a push after the removal",
              lambda: any(r["sync/servers_updated"] == 1 for r in read_metrics(run_dir / "learner.jsonl")[at_remove + 1 :]),
              proc, log)  # fmt: skip
        assert f"servers ['{new}'] removed from the server list" in _text(learner_log)
        proc.send_signal(signal.SIGTERM)  # stopped as an operator would: final checkpoint, account
        assert proc.wait(timeout=300) == 130, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not any(pid_alive(pid) for pid in _pids(log).values())
    records = read_metrics(run_dir / "learner.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert "routing to" in _text(run_dir / "logs" / "roller0.log")
    assert_account(run_dir)
