"""The launcher's Supervisor stops exactly its children, and a second stop signal during the
cleanup kills what is left instead of abandoning it (no orphans either way)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from agentrl.launcher import Supervisor
from tests.conftest import pid_alive

# a child that ignores SIGTERM, as a process stuck in a collective might
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def _started(supervisor: Supervisor, names: list[str]) -> list[int]:
    children = [supervisor.start(name, [sys.executable, "-c", STUBBORN]) for name in names]
    for child in children:  # wait until each has installed its handler
        while "up" not in child.log_path.read_text():
            assert child.proc.poll() is None
            threading.Event().wait(0.05)
    return [c.proc.pid for c in children]


@pytest.mark.timeout(60)  # without the second signal's kill, stop_all would wait 300 s per child
def test_a_second_stop_signal_kills_the_remaining_children(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_timeout_s=300)
    pids = _started(supervisor, ["a", "b", "c"])
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    supervisor.stop_all()
    timer.join()
    assert not any(pid_alive(pid) for pid in pids)
    assert signal.getsignal(signal.SIGTERM) is previous  # the cleanup's handler is gone again


@pytest.mark.timeout(60)
def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_timeout_s=0.5)
    pids = _started(supervisor, ["a", "b"])
    supervisor.stop_all()
    assert not any(pid_alive(pid) for pid in pids)


def test_the_plan_restarts_servers_and_rollers_but_not_the_learner(tmp_path: Path) -> None:
    from agentrl.config import AgentRLConfig
    from agentrl.launcher import plan_children

    config = AgentRLConfig.model_validate(
        {"run_dir": str(tmp_path), "inference": {"num_servers": 2}, "roller": {"num_processes": 2}}
    )
    specs = {s.name: s for s in plan_children(config, tmp_path / "c.yaml", "m", [], resume=True)}
    assert list(specs) == ["server0", "server1", "learner", "roller0", "roller1"]
    assert all(specs[n].restart for n in ("server0", "server1", "roller0", "roller1"))
    assert not specs["learner"].restart and "--resume" in specs["learner"].args
    port = specs["server1"].args[specs["server1"].args.index("--port") + 1]
    assert specs["server1"].health_url == f"http://127.0.0.1:{port}"
    assert specs["roller1"].env == {"AGENTRL_ROLLER_INDEX": "1"}
    servers = specs["roller0"].args[specs["roller0"].args.index("--inference.servers") + 1]
    assert servers == f"[{specs['server0'].health_url}, {specs['server1'].health_url}]"


@pytest.mark.timeout(60)
def test_a_dead_roller_is_restarted_with_backoff_until_its_restarts_run_out(tmp_path: Path) -> None:
    import json
    import time

    from agentrl.launcher import ChildSpec, supervise

    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    try:
        learner = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "import time; time.sleep(60)"]))
        server = supervisor.run(
            ChildSpec("server0", [sys.executable, "-c", "import time; time.sleep(60)"], restart=True)
        )
        roller = supervisor.run(ChildSpec("roller0", [sys.executable, "-c", "exit(3)"], restart=True))
        os.kill(server.proc.pid, signal.SIGKILL)  # kill -9 of a server: restarted, then it stays up
        deadline, outcome = time.monotonic() + 50, None
        while outcome is None and time.monotonic() < deadline:
            outcome = supervise(supervisor, learner, max_restarts=2, backoff_s=0.05)
            time.sleep(0.05)
        assert outcome == "failed"  # the roller kept dying: the run stops after its 2 restarts
        assert roller.restarts == 2 and server.restarts == 1 and server.proc.poll() is None
        records = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
        assert sorted((r["child"], r["restart"]) for r in records) == [
            ("roller0", 1), ("roller0", 2), ("server0", 1)
        ]  # fmt: skip
        assert {r["exit_code"] for r in records if r["child"] == "server0"} == {-signal.SIGKILL}
    finally:
        supervisor.stop_all()
    assert learner.proc.poll() is not None and server.proc.poll() is not None


@pytest.mark.timeout(30)
def test_the_learner_finishing_or_dying_ends_supervision(tmp_path: Path) -> None:
    from agentrl.launcher import ChildSpec, supervise

    supervisor = Supervisor(tmp_path)
    done = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "exit(0)"]))
    done.proc.wait()
    assert supervise(supervisor, done, 3, 0.0) == "done"
    dead = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "exit(1)"]))
    dead.proc.wait()
    assert supervise(supervisor, dead, 3, 0.0) == "failed"
