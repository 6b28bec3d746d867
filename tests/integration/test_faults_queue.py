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
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentrl.net import wait_healthy
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

    def roller(self, index: int, *extra: str, url: str | None = None) -> subprocess.Popen:
        return self.procs.agentrl(
            # started with the learner: on a loaded machine its queue can take over 30 s to bind
            "roller", *self.common, "--queue.connect_timeout_s=120", "--servers", url or self.url, "--roller.max_turns=2",
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

    def finish(self, proc: subprocess.Popen, timeout: float) -> int:
        """`proc`'s exit code, or a failure with every log's tail if it is still running after `timeout`."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout}s\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-n:]}" for p in sorted(self.tmp.glob("*.log")))

    def check_account(self, max_lost_undurable: int = 0) -> dict:
        """0 lost, 0 trained twice, 0 credits leaked, both invariants 0 at every step; groups a
        durability-off queue died holding are counted apart (`lost_undurable`), at most this many."""
        acct = account(self.dir)
        summary = acct.summary()
        assert acct.lost == 0, (summary, sorted(acct.lost_ids)[:5], self.tail())
        assert acct.lost_undurable <= max_lost_undurable, summary
        assert acct.duplicated == 0, summary
        assert acct.leaked_credits == 0, (summary, acct.final)
        assert acct.step_residuals and all(r == (0, 0) for r in acct.step_residuals), acct.step_residuals
        return summary


def _kill9(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait_for(predicate, what: str, run: Run, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout}s\n{run.tail()}"
        time.sleep(0.2)


class Freezer:
    """A TCP relay in front of the inference server that can stop passing generation requests on:
    a roller behind it whose generations hang (mid-episode, its groups admitted and not put).
    `held` counts the generation requests (POSTs) it swallowed while frozen. Health and version
    probes (GETs) still pass: a roller whose router waits for the server to reach the learner's
    version must see it get there, or it never sends a generation request to hang."""

    def __init__(self, target_url: str) -> None:
        self.target = ("127.0.0.1", int(target_url.rsplit(":", 1)[1]))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.frozen = threading.Event()
        self.held = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        swallowing = False  # this connection's POST was swallowed: so is all that follows on it
        try:
            while data := src.recv(65536):
                if requests and self.frozen.is_set() and (swallowing or b"POST " in data):
                    swallowing = True
                    self.held += data.count(b"POST ")
                    continue  # swallowed: the server never sees it, the roller waits for its answer
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.parametrize("k", [0, 2])
def test_one_of_two_rollers_killed_while_holding_credits(
    processes, tiny_model: Path, tmp_path: Path, k: int
) -> None:
    """The victim is killed mid-episode (its generations frozen, so it holds admitted, unput
    groups): its lease lapses and those credits come back (`admission_reclaimed` > 0) — at k=0 the
    run could not go on without them. The run completes, the survivor exits cleanly when the
    learner finishes, and the two rollers ran disjoint tasks."""
    run = Run(processes, tiny_model, tmp_path, k=k, steps=5)
    run.serve()
    freezer = Freezer(run.url)
    try:
        learner = run.learner()
        survivor, victim = run.roller(0), run.roller(1, url=freezer.url)
        run.wait_steps(2, learner)
        freezer.frozen.set()
        _wait_for(lambda: freezer.held > 0, "the victim sent no generation request", run)
        _kill9(victim)
        assert run.finish(learner, 300) == 0, run.tail()
        assert run.finish(survivor, 60) == 0, run.tail()  # told the run is over: a clean exit
    finally:
        freezer.close()
    summary = run.check_account()
    assert summary["reclaimed"] > 0, summary  # the victim's admitted-but-unput groups came back
    assert "roller roller-1 (lease" in run.tail(200000) and "admission credits reclaimed" in run.tail(200000)
    acct = account(run.dir)
    tasks0, tasks1 = acct.tasks["roller-0"], acct.tasks["roller-1"]
    assert tasks0 and tasks1 and not set(tasks0) & set(tasks1)  # one task stream, split
    assert len(set(tasks0)) == len(tasks0)
    final = acct.final
    assert final["leases"] == 0 and final["leases_lapsed"] >= 1


@pytest.mark.parametrize("k", [0, 2])
def test_learner_killed_twice_durability_off_then_on_and_resumed(
    processes, tiny_model: Path, tmp_path: Path, k: int
) -> None:
    """Two rows in one run. kill -9 of the learner hosting a durability-off queue, `--resume` with
    `--queue.durable true`, kill -9 again, `--resume`: the roller rides through (its lease is
    restored), admission is rebuilt at the checkpoint's version (no stall, no flood of stale
    groups), nothing is trained twice, what the first queue held is counted as lost with
    durability off (by the resumed queue and by the account), and nothing the durable queue
    acknowledged is lost."""
    # 8 steps: room for the third life to train (at 5, the second life sometimes finished all of them
    # before its kill landed)
    total = 8
    run = Run(processes, tiny_model, tmp_path, k=k, steps=total)
    ckpt, durable = "--learner.checkpoint.every=1", "--queue.durable=true"
    run.serve()
    learner = run.learner(ckpt)
    roller = run.roller(0, "--queue.silent_timeout_s=120")
    run.wait_steps(2, learner)
    _kill9(learner)  # durability off: the groups its queue held are gone
    before = run.steps()
    learner = run.learner(ckpt, durable, "--resume")
    run.wait_steps(before + 1, learner)
    # killed while the durable queue holds groups it acknowledged that nobody trained yet
    _wait_for(lambda: account(run.dir).lost_ids, "a group acknowledged and not yet trained", run)
    _kill9(learner)  # durable: the WAL keeps them
    assert run.steps() < total, "the second life trained every step before its kill: nothing left to resume"
    held = account(run.dir).lost_ids  # acknowledged by the durable life, neither trained nor dropped
    before = run.steps()
    learner = run.learner(ckpt, durable, "--resume")
    assert run.finish(learner, 300) == 0, run.tail()
    assert run.finish(roller, 60) == 0, run.tail()
    assert run.steps() > before
    final = account(run.dir).final
    assert final["version"] == total
    # the third life recovered from the WAL at least what the durable life held (a put it stored
    # but died before acknowledging is recovered too), and counted what it says it recovered
    said = re.findall(
        r"WAL: recovered (\d+) unacked groups", sorted(run.tmp.glob("*-learner.log"))[-1].read_text()
    )
    assert held and [int(n) for n in said] == [final["recovered"]], (len(held), said, final["recovered"])
    assert final["recovered"] >= len(held), (len(held), final["recovered"])
    summary = run.check_account(max_lost_undurable=(k + 2) * GPS)
    assert final["dropped_stale"] <= GPS, summary  # the resumed queue did not flood with stale groups
    told = max(r.get("queue/lost_undurable", 0) for r in read_jsonl(run.dir / "learner.jsonl"))
    assert told >= summary["lost_undurable"]  # the second life's queue counted what the first lost
    if summary["lost_undurable"]:
        assert "died holding" in run.tail(200000)


@pytest.mark.parametrize("k", [0, 2])
def test_standalone_durable_queue_sigterm_resume_and_a_wrong_address_or_secret(
    processes, tiny_model: Path, tmp_path: Path, k: int
) -> None:
    """The learner consumes from `agentrl queue` (it does not bind one); SIGTERM takes it through
    its final checkpoint and queue state; `--resume` finishes the run on the same queue, and the
    roller exits when told the run is over. Meanwhile a roller pointed at nothing, and one with
    another secret, say so and exit 1 (the queue logs the refused MACs at WARNING) and change
    nothing. Nothing acknowledged is lost or trained twice."""
    steps = 4
    run = Run(processes, tiny_model, tmp_path, k=k, steps=steps)
    run.serve()
    queue = processes.agentrl("queue", "--bind", run.address, *run.common, "--queue.durable=true",
                              env=run.env, stdout=run._log("queue"), stderr=subprocess.STDOUT)  # fmt: skip
    learner = run.learner("--queue.standalone=true")
    roller = run.roller(0)
    fast = ["--queue.connect_timeout_s=3", "--servers", "http://127.0.0.1:9"]
    elsewhere = f"tcp://127.0.0.1:{find_free_port()}"  # an address nothing binds
    nowhere = processes.agentrl(
        "roller", *[f"--queue.address={elsewhere}" if a.startswith("--queue.address=") else a for a in run.common],
        "--roller.index=8", *fast, env=run.env, stdout=run._log("nowhere"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    wrong = dict(run.env, AGENTRL_QUEUE_SECRET="another-secret-entirely-0000000000")
    intruder = processes.agentrl("roller", *run.common, "--roller.index=7", *fast, env=wrong,
                                 stdout=run._log("intruder"), stderr=subprocess.STDOUT)  # fmt: skip
    run.wait_steps(2, learner)
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=120) == 128 + signal.SIGTERM, run.tail()
    stopped_at = run.steps()
    latest = (run.dir / "checkpoints" / "latest").read_text().strip()
    assert latest.endswith(f"{stopped_at:08d}") or str(stopped_at) in latest, latest  # the final checkpoint
    assert json.loads((run.dir / "queue_final.json").read_text())["version"] == stopped_at
    assert queue.poll() is None and roller.poll() is None  # the queue outlives the learner
    learner = run.learner("--queue.standalone=true", "--resume")
    assert run.finish(learner, 300) == 0, run.tail()
    assert run.finish(roller, 60) == 0, run.tail()
    assert nowhere.wait(timeout=120) == 1 and intruder.wait(timeout=120) == 1
    queue.send_signal(signal.SIGTERM)  # it writes the ids it still holds to the ledger
    assert run.finish(queue, 30) == 0, run.tail()
    logs = run.tail(200000)
    assert "no answer from the queue at" in logs and "AGENTRL_QUEUE_SECRET" in logs
    assert "failed its MAC" in logs  # the queue's WARNING
    summary = run.check_account()
    assert summary["trained"] == steps * GPS, summary
    tasks = account(run.dir).tasks
    assert tasks["roller-0"] and not tasks.get("roller-7") and not tasks.get("roller-8")  # they put nothing
