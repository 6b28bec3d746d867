"""A real `agentrl sandbox-server` process and the remote client: same interface, same
containment, and nobody without the API key gets in."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request

import pytest

from agentrl.config import RemoteSandboxConfig
from agentrl.envs.sandbox import SandboxError, create
from tests.conftest import Processes
from tests.unit.envs.sandbox.conftest import AVAILABLE

pytestmark = [pytest.mark.slow, pytest.mark.integration]
KEY = "test-key-" + os.urandom(8).hex()


def start_server(processes: Processes, port: int, *args: str) -> str:
    level = "bwrap" if "bwrap" in AVAILABLE else AVAILABLE[0]
    processes.agentrl(
        "sandbox-server", "--port", str(port), "--min-isolation", level, "--memory-mb", "256", "--timeout", "2",
        "--max-sandboxes", "2", *args, env={**os.environ, "AGENTRL_SANDBOX_KEY": KEY},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise AssertionError("sandbox server did not come up")


async def test_remote_sandbox_round_trip(processes: Processes, free_port: int, monkeypatch) -> None:
    url = start_server(processes, free_port)
    monkeypatch.setenv("AGENTRL_SANDBOX_KEY", KEY)
    config = RemoteSandboxConfig(url=url, timeout_s=30)
    async with create(config) as box:
        assert box.isolation in AVAILABLE
        await box.write_file("main.py", "import sys; print('hello', sys.argv[1])")
        result = await box.exec(["python3", "main.py", "remote"])
        assert (result.exit_code, result.stdout, result.timed_out) == (0, "hello remote\n", False)
        assert await box.read_file("main.py") == b"import sys; print('hello', sys.argv[1])"
        with pytest.raises(FileNotFoundError):
            await box.read_file("nope.txt")
        with pytest.raises(PermissionError):
            await box.write_file("/etc/evil", "x")
        # the client asks for 60 s; the server caps it at its own 2 s
        slow = await box.exec("sleep 1000", timeout=60)
        assert slow.timed_out
        assert "timed out after 2s" in slow.stderr

        # the server holds at most 2 sandboxes: a third is refused, and refusal is an error, not a hang
        second = create(config)
        await second.start()
        third = create(config)
        with pytest.raises(SandboxError, match="429"):
            await third.start()
        await second.close()
        await asyncio.gather(third.close(), second.close())  # closing twice / never started is fine

    # after close the server forgot the sandbox
    assert box.id is None


async def test_wrong_api_key_is_refused(processes: Processes, free_port: int, monkeypatch) -> None:
    url = start_server(processes, free_port)
    request = urllib.request.Request(url + "/sandboxes", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 401
    monkeypatch.setenv("AGENTRL_SANDBOX_KEY", "wrong")
    with pytest.raises(SandboxError, match="401"):
        await create(RemoteSandboxConfig(url=url)).start()
    monkeypatch.delenv("AGENTRL_SANDBOX_KEY")
    with pytest.raises(SandboxError, match="AGENTRL_SANDBOX_KEY"):
        create(RemoteSandboxConfig(url=url))


def test_server_refuses_to_start_without_a_key() -> None:
    from tests.conftest import run_agentrl

    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_SANDBOX_KEY"}
    result = run_agentrl("sandbox-server", "--port", "1", "--api-key-env", "AGENTRL_NO_SUCH_KEY", env=env)
    assert result.returncode == 2
    assert "AGENTRL_NO_SUCH_KEY" in result.stderr


async def test_swe_task_graded_on_a_shared_sandbox_host(
    processes: Processes, free_port: int, tmp_path, monkeypatch
) -> None:
    """The repository snapshot is uploaded to the server; the right patch scores 1, none 0."""
    from agentrl.envs.swe.grading import grade_patch
    from agentrl.envs.swe.synthetic import generate

    url = start_server(processes, free_port, "--python-packages", "pytest", "--timeout", "60")
    monkeypatch.setenv("AGENTRL_SANDBOX_KEY", KEY)
    [task] = generate(tmp_path, 1, seed=11)
    config = RemoteSandboxConfig(url=url)
    async with create(config) as box:  # nothing of the snapshot unless it is given
        assert (await box.exec("ls")).stdout == ""
    assert (await grade_patch(config, task, task.patch, timeout=30)).reward == 1.0
    unfixed = await grade_patch(config, task, "", timeout=30)
    assert unfixed.reward == 0.0 and all(unfixed.pass_to_pass.values())


async def test_server_side_refusals_reach_the_client(free_port: int, monkeypatch, tmp_path) -> None:
    """A link planted in the sandbox is refused (403 -> PermissionError) and a full disk quota is
    the server's ENOSPC (422 -> OSError), both through a real server in this process."""
    from aiohttp import web

    from agentrl.config import LocalSandboxConfig
    from agentrl.envs.sandbox.server import SandboxServer

    level = "bwrap" if "bwrap" in AVAILABLE else AVAILABLE[0]
    server = SandboxServer(LocalSandboxConfig(isolation=level, min_isolation="none", disk_mb=16), KEY)
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port).start()
    monkeypatch.setenv("AGENTRL_SANDBOX_KEY", KEY)
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    try:
        async with create(RemoteSandboxConfig(url=f"http://127.0.0.1:{free_port}", timeout_s=30)) as box:
            await box.exec(f"ln -s {secret} link && ln -s {tmp_path} dirlink")
            with pytest.raises(PermissionError, match="symbolic link"):
                await box.read_file("link")
            with pytest.raises(PermissionError, match="symbolic link"):
                await box.write_file("dirlink/new.txt", "x")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]
            if os.geteuid() == 0:  # the quota needs root
                with pytest.raises(OSError, match="No space left") as info:
                    await box.write_file("big.bin", b"\0" * (32 << 20))
                assert info.value.errno == 28
    finally:
        await runner.cleanup()
