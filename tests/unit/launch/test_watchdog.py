"""The launchers' health watchdog (`agentrl/launch/watchdog.py`): which servers it names, when, and
with what (on a fake clock and probe); `net.probe` against real sockets; and the local launcher's
`supervise` stopping and restarting a real server process that answers 503 on /health, until its
restarts run out."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from concurrent.futures import Executor, Future
from pathlib import Path

import pytest

from agentrl.launch.procs import ChildSpec, Supervisor
from agentrl.launch.watchdog import HealthWatch
from agentrl.net import probe
from tests.conftest import find_free_port, pid_alive

URL = "http://127.0.0.1:1"


class Inline(Executor):
    """Runs each probe at once, in the caller."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class Never(Executor):
    """Probes that never come back (a server that accepts and never answers, a stuck thread)."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        self.submitted += 1
        return Future()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(answers: list, clock: Clock, **kw) -> HealthWatch:
    """A watch whose probes answer `answers[0]` (None: 200), on `clock`."""
    kw = {"unhealthy_after_s": 60, "startup_s": 300, "interval_s": 2, **kw}
    return HealthWatch(probe=lambda url, path, timeout_s: answers[0], clock=clock, pool=Inline(), **kw)


def _run(watch: HealthWatch, clock: Clock, seconds: float, servers: dict, step: float = 0.5) -> dict:
    """Rounds every `step` s of fake time for `seconds`; every server named meanwhile, with why."""
    named = {}
    end = clock.now + seconds
    while clock.now < end:
        named.update(watch.check(servers))
        clock.now += step
    return named


def test_a_server_unhealthy_for_longer_than_the_limit_is_named_once_with_what_was_seen() -> None:
    clock, answers = Clock(), [None]
    watch = _watch(answers, clock)
    servers = {"server0": (URL, 111)}
    assert _run(watch, clock, 600, servers) == {}  # healthy: never named
    answers[0] = "HTTP 503"  # its engine died; the process lives on
    assert _run(watch, clock, 59, servers) == {}
    named = _run(watch, clock, 5, servers)
    assert list(named) == ["server0"]
    assert named["server0"].startswith("unhealthy: ")
    assert f"{URL}/health" in named["server0"] and "last probe seen: HTTP 503" in named["server0"]
    assert "launcher.unhealthy_after_s" in named["server0"]
    assert _run(watch, clock, 600, servers) == {}  # named once per incarnation


def test_a_short_outage_is_forgiven() -> None:
    clock, answers = Clock(), [None]
    watch = _watch(answers, clock)
    servers = {"server0": (URL, 111)}
    _run(watch, clock, 10, servers)
    answers[0] = "no answer in 5s"  # paused, busy, stopped for a while
    assert _run(watch, clock, 50, servers) == {}
    answers[0] = None
    assert _run(watch, clock, 600, servers) == {}


def test_a_restarted_server_gets_the_startup_timeout_until_it_first_answers() -> None:
    clock, answers = Clock(), ["Connection refused"]
    watch = _watch(answers, clock)
    assert _run(watch, clock, 290, {"server0": (URL, 111)}) == {}  # loading its model
    named = _run(watch, clock, 20, {"server0": (URL, 111)})
    assert "since the server started" in named["server0"] and "Connection refused" in named["server0"]
    # restarted (a new pid): its clock starts afresh, and once healthy the short limit applies
    assert _run(watch, clock, 290, {"server0": (URL, 222)}) == {}
    answers[0] = None
    _run(watch, clock, 5, {"server0": (URL, 222)})
    answers[0] = "HTTP 503"
    assert "server0" in _run(watch, clock, 65, {"server0": (URL, 222)})


def test_a_probe_that_never_returns_neither_blocks_a_round_nor_hides_the_server() -> None:
    clock, pool = Clock(), Never()
    watch = HealthWatch(60, 300, interval_s=2, clock=clock, pool=pool)
    named = _run(watch, clock, 301, {"server0": (URL, 1), "server1": (URL, 2)})
    assert sorted(named) == ["server0", "server1"]
    assert "last probe seen: no answer yet" in named["server0"] and "has not answered yet" in named["server0"]
    assert pool.submitted == 2  # one probe in flight per server, never a pile of them


def test_probes_are_spaced_and_forgotten_servers_dropped() -> None:
    clock, calls = Clock(), []
    watch = HealthWatch(
        60, 300, interval_s=2, clock=clock, pool=Inline(), probe=lambda *a: calls.append(a[0]) or None
    )
    _run(watch, clock, 10, {"server0": (URL, 1)}, step=0.5)
    assert len(calls) == 5  # every 2 s, not every 0.5 s round
    _run(watch, clock, 1, {})
    assert watch.seen == {}


def test_zero_turns_the_watchdog_off() -> None:
    clock = Clock()
    watch = _watch(["HTTP 503"], clock, unhealthy_after_s=0)
    assert _run(watch, clock, 10_000, {"server0": (URL, 1)}) == {}


def test_probe_says_what_it_saw(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe(url) is None
        assert probe(url, "/dead") == "HTTP 503"
        assert probe(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3) == "no answer in 0.3s"
        assert "refused" in probe(f"http://127.0.0.1:{find_free_port()}").lower()
    finally:
        server.shutdown()
        silent.close()


# A server whose engine died: the process lives, /health answers 503 (as vLLM's does when its
# EngineCore is gone) and every other request 500. `ignore_term`: it ignores SIGTERM too.
DEAD_ENGINE = """
import signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if sys.argv[2] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if self.path == "/health" else 500)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignore_term", [False, True], ids=["stops-on-sigterm", "needs-sigkill"])
def test_supervise_restarts_an_unhealthy_server_then_ends_the_run_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignore_term: bool
) -> None:
    from agentrl.launch import local

    monkeypatch.setattr(local, "KILL_AFTER_S", 0.5)
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-c", DEAD_ENGINE, str(port), "1" if ignore_term else "0"]
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("agentrl.launch.local").addHandler(handler)
    supervisor = Supervisor(tmp_path, stop_timeout_s=2)
    pids = []
    try:
        learner = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "import time; time.sleep(60)"]))
        server = supervisor.run(ChildSpec("server0", args, restart=True, health_url=url))
        health = HealthWatch(unhealthy_after_s=0.5, startup_s=3, interval_s=0.1, timeout_s=1)
        deadline, outcome = time.monotonic() + 50, None
        while outcome is None and time.monotonic() < deadline:
            pids.append(server.proc.pid)
            outcome = local.supervise(supervisor, learner, max_restarts=1, backoff_s=0.05, health=health)
            time.sleep(0.05)
        health.close()
        assert outcome == "failed" and server.restarts == 1
        records = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
        assert [(r["child"], r["restart"]) for r in records] == [("server0", 1)]
        assert records[0]["why"].startswith("unhealthy: ") and "HTTP 503" in records[0]["why"]
        final = said[-1]
        assert final.startswith("server0 was stopped by the launcher (unhealthy: ") and "HTTP 503" in final
        assert "launcher.max_restarts" in final and "stopping the run" in final
        assert not any(pid_alive(pid) for pid in set(pids))  # both incarnations gone, none orphaned
        assert learner.proc.poll() is None  # only the server was stopped
    finally:
        logging.getLogger("agentrl.launch.local").removeHandler(handler)
        supervisor.stop_all()
