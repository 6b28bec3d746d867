"""`agentrl run`'s colocated launcher: a SIGTERM to it stops its child, even one that ignores it."""

from __future__ import annotations

import os
import signal
import sys
import threading

from agentrl.launch import colocated as launch


def test_sigterm_stops_the_child_and_kills_one_that_ignores_it(monkeypatch) -> None:
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = launch._run([sys.executable, "-c", stubborn])
    finally:
        timer.cancel()
    assert code == -signal.SIGKILL  # it ignored SIGTERM, so it was killed after the grace
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


def test_a_child_that_exits_gives_its_code() -> None:
    assert launch._run([sys.executable, "-c", "raise SystemExit(3)"]) == 3
