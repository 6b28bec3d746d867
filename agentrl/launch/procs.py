"""The processes a launcher starts on this machine: `ChildSpec` (one process of a plan), `Child`
(one started), `Supervisor` (starts children in their own process groups, restarts and stops
exactly those, by PID) and `die_with_parent`. Used by the local launcher (`local.py`), the Ray
actors (`ray_actor.py`) and the live server list (`servers.py`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.log import get_logger

logger = get_logger(__name__)


@dataclass
class ChildSpec:
    """One process of the plan: what to run, and whether it is restarted when it dies."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = False
    health_url: str | None = None  # start-up waits until it answers /health


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    spec: ChildSpec | None = None
    restarts: int = 0
    restart_at: float | None = None  # when a dead restartable child is started again
    stopped_why: str | None = None  # why the launcher stopped it (unhealthy), until it is restarted
    kill_at: float | None = None  # when a child stopped as unhealthy that still runs gets SIGKILL


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child, before exec: have the kernel send it `sig` when its parent dies (Linux only;
    elsewhere a no-op). The parent is the thread that started it, so start children from a
    thread that outlives them."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


class Supervisor:
    """Starts children in their own process groups and stops exactly those (by PID)."""

    def __init__(self, run_dir: Path, stop_timeout_s: float = 30) -> None:
        self.run_dir = run_dir
        self.stop_timeout_s = stop_timeout_s
        self.children: list[Child] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, args: list[str], env: dict[str, str] | None = None, threads: int | None = 1
    ) -> Child:
        """Start a child; `threads` caps its intra-op threads (servers and learner share the cores,
        and oversubscribed OpenMP threads slow small models several-fold). None: the default."""
        child = Child(name, self._spawn(name, args, env, threads), self.run_dir / "logs" / f"{name}.log")
        self.children.append(child)
        return child

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None, threads: int | None = 1):
        log_path = self.run_dir / "logs" / f"{name}.log"
        if threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
        log_file = log_path.open("ab")
        proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )
        log_file.close()
        logger.info("started %s (pid %d), log: %s", name, proc.pid, log_path)
        return proc

    def run(self, spec: ChildSpec) -> Child:
        """Start the child a plan entry describes."""
        child = self.start(spec.name, spec.args, env=spec.env)
        child.spec = spec
        return child

    def restart(self, child: Child) -> None:
        """Start a dead child again with the same command line (a server on the same port)."""
        assert child.spec is not None and child.proc.poll() is not None
        child.proc = self._spawn(child.name, child.spec.args, child.spec.env)
        child.restarts, child.restart_at = child.restarts + 1, None
        child.stopped_why = child.kill_at = None

    def failed(self) -> Child | None:
        """The first child that exited with an error, if any."""
        for child in self.children:
            code = child.proc.poll()
            if code not in (None, 0):
                return child
        return None

    def signal(self, child: Child, *sigs: int) -> None:
        """Send `sigs` to the child's process group, without waiting (a group already gone: nothing)."""
        for sig in sigs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, sig)

    def stop(self, child: Child) -> None:
        if child.proc.poll() is not None:
            return
        try:
            os.killpg(child.proc.pid, signal.SIGTERM)
            child.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %ss; killing it and the rest", child.name, self.stop_timeout_s)
            self.kill_all()
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                self.signal(child, signal.SIGKILL)
                child.proc.wait()

    def stop_all(self) -> None:
        """SIGTERM each child (newest first) and wait for it. A second Ctrl-C / SIGTERM during
        this does not abandon the cleanup half-way: it kills what is left, at once."""

        def hurry(signum: int, frame: object) -> None:
            logger.warning("second stop signal: killing the remaining processes")
            self.kill_all()

        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, hurry) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            for child in reversed(self.children):
                self.stop(child)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def tail(self, child: Child, lines: int = 15) -> str:
        try:
            return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def agentrl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl", *args]


def warm_model(run_dir: Path) -> Path | None:
    """The warm start a previous attempt of this run finished, if any (resume skips redoing it)."""
    path = run_dir / "warmstart"
    return path if (path / "config.json").exists() and any(path.glob("*.safetensors")) else None
