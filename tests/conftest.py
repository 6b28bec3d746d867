"""Shared fixtures: a free loopback port, the tiny model (built once per session) and
processes started by a test, stopped by PID at teardown (never by name)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def find_free_port() -> int:
    from agentrl.net import free_port

    return free_port()  # below the kernel's ephemeral range: no race with servers that bind 0


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real HF Qwen2-style checkpoint written by `agentrl init-model tiny` code."""
    from agentrl.tiny_model import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real HF Qwen2-MoE checkpoint written by `agentrl init-model tiny-moe` code."""
    from agentrl.tiny_model import init_model

    return init_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


class Processes:
    """Starts subprocesses in their own process group and stops exactly those at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def agentrl(self, *args: str, **kwargs) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "agentrl", *args], **kwargs)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.stop_all()


def run_agentrl(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `agentrl` command line in a child process and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "agentrl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 240) -> None:
    """Run `script args` as `nproc` local ranks under torchrun (one intra-op thread each, a free
    port); fails the test with the ranks' stderr if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={find_free_port()}", "--master_addr=127.0.0.1", script, *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]


def end_rank() -> None:
    """How a torchrun rank script ends: torch.distributed processes sometimes abort at exit after
    their work is done, so leave the group, flush, and exit without the interpreter's teardown."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (a child that was waited for does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port for the whole session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run does)")
    port = find_free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def require_private_mounts() -> str:
    """The path of unshare(1), or skip the test: it needs a private mount namespace (root) to mount
    a small tmpfs of its own."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                           capture_output=True) if unshare else None  # fmt: skip
    if probe is None or probe.returncode != 0:
        pytest.skip(
            "needs unshare(1) and the right to make a private mount namespace (root) for a small tmpfs"
        )
    return unshare
