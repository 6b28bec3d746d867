"""Fault injection for the queue / roller / learner-lifetime rows of issue 14, with real processes
started by hand as on separate nodes (`agentrl serve`, `learner`, `queue`, `roller`), the tiny
model, groups_per_step 4, group_size 4 and a few steps. Every scenario ends with the per-group
account of `agentrl/queue/account.py` (lost / duplicated / leaked credits), not only exit codes, and
checks the queue's two invariants in every step the learner logged.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/test_faults_queue.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentrl.launcher import wait_healthy
from agentrl.queue.account import account, read_jsonl
from tests.conftest import Processes, find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(420)]

SECRET = "faults-queue-secret-0123456789abcdef"
GPS = 4
FAST_QUEUE = ["--queue.heartbeat_s=0.5", "--queue.roller_lease_s=3"]


class Run:
    """One run's processes, addresses and folder."""

    def __init__(self, processes: Processes, tiny_model: Path, tmp_path: Path, k: int, steps: int) -> None:
        self.procs, self.dir, self.k = processes, tmp_path / "run", k
        self.env = {**os.environ, "AGENTRL_QUEUE_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
        self.url = f"http://127.0.0.1:{find_free_port()}"
        self.address = f"tcp://127.0.0.1:{find_free_port()}"
        self.tiny_model, self.tmp = tiny_model, tmp_path
        self.common = [
            "--config", "recipes/quickstart.yaml", f"--learner.model_path={tiny_model}", f"--run_dir={self.dir}",
            f"--max_staleness={k}", f"--learner.groups_per_step={GPS}", "--roller.group_size=4",
            f"--queue.address={self.address}", *FAST_QUEUE,
        ]  # fmt: skip
        self.learner_args = [
            "--learner.warmstart.steps=0", f"--learner.max_steps={steps}", "--learner.batch_timeout_s=2",
            "--inference.servers", f"[{self.url}]", "--weight_sync={type: disk}",
        ]  # fmt: skip
        self.logs = 0

    def _log(self, name: str):
        self.logs += 1
        return (self.tmp / f"{self.logs:02d}-{name}.log").open("wb")

    def serve(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        server = self.procs.agentrl("serve", "--model", str(self.tiny_model), "--port", port, env=self.env,
                                    stdout=self._log("serve"), stderr=subprocess.STDOUT)  # fmt: skip
        wait_healthy([self.url], [server])

    def learner(self, *extra: str) -> subprocess.Popen:
        return self.procs.agentrl("learner", *self.common, *self.learner_args, *extra, env=self.env,
                                  stdout=self._log("learner"), stderr=subprocess.STDOUT)  # fmt: skip

    def roller(self, index: int, *extra: str) -> subprocess.Popen:
        return self.procs.agentrl(
            "roller", *self.common, "--servers", self.url, "--roller.max_turns=2",
            "--roller.max_concurrent_episodes=8", f"--roller.index={index}", *extra,
            env=self.env, stdout=self._log(f"roller{index}"), stderr=subprocess.STDOUT,
        )  # fmt: skip

    def steps(self) -> int:
        return len(read_jsonl(self.dir / "learner.jsonl"))

    def wait_steps(self, n: int, learner: subprocess.Popen, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while self.steps() < n:
            assert learner.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"fewer than {n} steps in {timeout}s\n{self.tail()}"
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-n:]}" for p in sorted(self.tmp.glob("*.log")))

    def check_account(self, max_lost: int = 0) -> dict:
        acct = account(self.dir)
        summary = acct.summary()
        assert acct.lost <= max_lost, (summary, sorted(acct.lost_ids)[:5], self.tail())
        assert acct.duplicated == 0, summary
        assert acct.leaked_credits == 0, (summary, acct.final)
        assert acct.step_residuals and all(r == (0, 0) for r in acct.step_residuals), acct.step_residuals
        return summary


def _kill9(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("k", [0, 2])
def test_one_of_two_rollers_killed(processes, tiny_model: Path, tmp_path: Path, k: int) -> None:
    """The dead roller's credits come back (its lease lapses), the run completes, the survivor
    exits cleanly when the learner finishes, and the two rollers ran disjoint tasks."""
    run = Run(processes, tiny_model, tmp_path, k=k, steps=6)
    run.serve()
    learner = run.learner()
    survivor, victim = run.roller(0), run.roller(1)
    run.wait_steps(2, learner)
    _kill9(victim)
    assert learner.wait(timeout=300) == 0, run.tail()
    assert survivor.wait(timeout=60) == 0, run.tail()  # told the run is over: a clean exit
    summary = run.check_account()
    assert summary["reclaimed"] > 0, summary  # the victim's admitted-but-unput groups came back
    acct = account(run.dir)
    tasks0, tasks1 = acct.tasks["roller-0"], acct.tasks["roller-1"]
    assert tasks0 and tasks1 and not set(tasks0) & set(tasks1)  # one task stream, split
    assert len(set(tasks0)) == len(tasks0)
    final = acct.final
    assert final["leases"] == 0 and final["leases_lapsed"] >= 1


@pytest.mark.parametrize("durable", [False, True], ids=["hosted", "durable"])
def test_learner_killed_and_resumed(processes, tiny_model: Path, tmp_path: Path, durable: bool) -> None:
    """kill -9 of the learner after its checkpoint, then `--resume` on the same address: the
    rollers ride through (their leases are restored), admission is rebuilt at the checkpoint's
    version (no stall, no flood of stale groups), nothing is trained twice, and with a durable
    queue nothing acknowledged is lost."""
    k = 1
    run = Run(processes, tiny_model, tmp_path, k=k, steps=6)
    extra = ["--learner.checkpoint.every=2", f"--queue.durable={str(durable).lower()}"]
    run.serve()
    learner = run.learner(*extra)
    roller = run.roller(0, "--queue.silent_timeout_s=120")
    run.wait_steps(3, learner)
    _kill9(learner)
    steps_before = run.steps()
    learner = run.learner(*extra, "--resume")
    assert learner.wait(timeout=300) == 0, run.tail()
    assert roller.wait(timeout=60) == 0, run.tail()
    assert run.steps() > steps_before
    # a non-durable queue loses what it held when it died: at most the admission window
    summary = run.check_account(max_lost=0 if durable else (k + 2) * GPS)
    final = account(run.dir).final
    assert final["version"] == 6
    assert final["dropped_stale"] <= GPS, summary  # the resumed queue did not flood with stale groups
    assert final["admission_restored"] > 0 or final["admitted"] > 0


def test_sigterm_then_resume_on_a_standalone_durable_queue(
    processes, tiny_model: Path, tmp_path: Path
) -> None:
    """The learner consumes from `agentrl queue` (it does not bind one); SIGTERM takes it through
    its final checkpoint and queue state; `--resume` finishes the run on the same queue, and the
    roller exits when told the run is over. Nothing acknowledged is lost or trained twice."""
    run = Run(processes, tiny_model, tmp_path, k=1, steps=5)
    run.serve()
    queue = processes.agentrl("queue", "--bind", run.address, *run.common, "--queue.durable=true",
                              env=run.env, stdout=run._log("queue"), stderr=subprocess.STDOUT)  # fmt: skip
    learner = run.learner("--queue.standalone=true")
    roller = run.roller(0)
    run.wait_steps(2, learner)
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=120) == 128 + signal.SIGTERM, run.tail()
    stopped_at = run.steps()
    latest = (run.dir / "checkpoints" / "latest").read_text().strip()
    assert latest.endswith(f"{stopped_at:08d}") or str(stopped_at) in latest, latest  # the final checkpoint
    assert json.loads((run.dir / "queue_final.json").read_text())["version"] == stopped_at
    assert queue.poll() is None and roller.poll() is None  # the queue outlives the learner
    learner = run.learner("--queue.standalone=true", "--resume")
    assert learner.wait(timeout=300) == 0, run.tail()
    assert roller.wait(timeout=60) == 0, run.tail()
    queue.send_signal(signal.SIGTERM)  # it writes the ids it still holds to the ledger
    assert queue.wait(timeout=30) == 0, run.tail()
    summary = run.check_account()
    assert summary["trained"] == 5 * GPS, summary


def test_wrong_address_or_secret_is_reported_not_waited_on(
    processes, tiny_model: Path, tmp_path: Path
) -> None:
    """A roller pointed at nothing, or at a queue with another secret, says so and exits non-zero;
    the queue logs the refused MACs at WARNING."""
    run = Run(processes, tiny_model, tmp_path, k=0, steps=1)
    fast = ["--queue.connect_timeout_s=3", "--servers", "http://127.0.0.1:9"]
    # an address nothing ever binds (the run's own address gets a queue below: a roller started
    # before it binds could reach it within its connect timeout on a quick machine)
    elsewhere = f"tcp://127.0.0.1:{find_free_port()}"
    nowhere = processes.agentrl(
        "roller", *[f"--queue.address={elsewhere}" if a.startswith("--queue.address=") else a for a in run.common],
        *fast, env=run.env, stdout=run._log("nowhere"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    queue = processes.agentrl("queue", "--bind", run.address, *run.common, env=run.env,
                              stdout=run._log("queue"), stderr=subprocess.STDOUT)  # fmt: skip
    wrong = dict(run.env, AGENTRL_QUEUE_SECRET="another-secret-entirely-0000000000")
    intruder = processes.agentrl("roller", *run.common, "--roller.index=1", *fast, env=wrong,
                                 stdout=run._log("intruder"), stderr=subprocess.STDOUT)  # fmt: skip
    assert nowhere.wait(timeout=120) == 1
    assert intruder.wait(timeout=120) == 1
    logs = run.tail(20000)
    assert "no answer from the queue at" in logs and "AGENTRL_QUEUE_SECRET" in logs
    assert "failed its MAC" in logs  # the queue's WARNING
    queue.send_signal(signal.SIGTERM)
    queue.wait(timeout=30)
    assert not list(run.dir.glob("roller-*.groups")) or account(run.dir).put == set()
