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
