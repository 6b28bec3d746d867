"""The local sandbox as a tool env uses it: files in and out, state across execs, refusals,
and the basic guarantees (timeout, no leftovers, truncation) at every isolation level here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import LocalSandboxConfig
from agentrl.envs.sandbox import SandboxError, create
from agentrl.envs.sandbox.base import OutputCapture, truncate_output
from agentrl.envs.sandbox.local import LocalSandbox
from tests.conftest import run_agentrl
from tests.unit.envs.sandbox.conftest import AVAILABLE, local_config, needs_bwrap, processes_with

LEVELS = [level for level in AVAILABLE if level != "none"]


def test_output_capture_keeps_head_and_tail() -> None:
    capture = OutputCapture(100)
    for _ in range(1000):
        capture.feed(b"0123456789")
    capture.feed(b"THE-END")
    text = capture.text()
    assert text.startswith("0123456789" * 5)
    assert text.endswith("THE-END")
    assert "[... 9907 bytes truncated ...]" in text
    assert OutputCapture(100).text() == ""
    assert truncate_output(b"short", 100) == "short"
    assert "[... 10 bytes truncated ...]" in truncate_output(b"x" * 110, 100)


@pytest.mark.parametrize("level", LEVELS)
async def test_timeout_leftovers_and_truncation_at_every_level(level: str) -> None:
    box = LocalSandbox(local_config(level))
    await box.start()
    try:
        assert box.isolation == level
        marker = "5151.5"
        result = await box.exec(f"sleep {marker} & sleep {marker}", timeout=1)
        assert result.timed_out
        assert processes_with(f"sleep {marker}") == []
        flood = await box.exec("head -c 3000000 /dev/zero | tr '\\0' y")
        assert flood.exit_code == 0
        assert "truncated" in flood.stdout
        assert len(flood.stdout) < box.config.max_output_bytes + 100
    finally:
        await box.close()
    assert box.root is None


@pytest.mark.parametrize("level", LEVELS)
async def test_files_round_trip_and_state_persists(level: str, tmp_path: Path) -> None:
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "mod.py").write_text("VALUE = 1\n")
    box = create(local_config(level))
    await box.start(str(tmp_path / "repo"))
    try:
        assert (await box.read_file("pkg/mod.py")) == b"VALUE = 1\n"
        await box.write_file("pkg/new/deep.py", "print('deep')\n")
        result = await box.exec("python3 pkg/new/deep.py && echo more >> pkg/mod.py && cat pkg/mod.py")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "deep\nVALUE = 1\nmore\n"
        assert await box.read_file(f"{box.workdir}/pkg/mod.py") == b"VALUE = 1\nmore\n"
        with pytest.raises(FileNotFoundError):
            await box.read_file("missing.txt")
        await box.exec("echo scratch > $TMPDIR/s.txt")
        assert (await box.exec("cat $TMPDIR/s.txt")).stdout == "scratch\n"
    finally:
        await box.close()
    assert (tmp_path / "repo" / "pkg" / "mod.py").read_text() == "VALUE = 1\n"  # the source is untouched


async def test_refuses_less_than_min_isolation() -> None:
    box = LocalSandbox(LocalSandboxConfig(isolation="rlimits", min_isolation="namespaces"))
    with pytest.raises(SandboxError, match="min_isolation"):
        await box.start()
    assert box.root is None


async def test_unavailable_isolation_is_an_error_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bwrap / unshare
    box = LocalSandbox(LocalSandboxConfig(isolation="bwrap"))
    with pytest.raises(SandboxError, match=r"sandbox\.isolation='bwrap' is not available"):
        await box.start()
    auto = LocalSandbox(LocalSandboxConfig())  # auto picks the best there is, which is below the minimum
    with pytest.raises(SandboxError, match="refusing to run untrusted code"):
        await auto.start()


def test_argv_and_exit_codes() -> None:
    import asyncio

    async def run() -> tuple[int, int, str]:
        async with create(local_config(LEVELS[0])) as box:
            killed = await box.exec(
                ["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
            )
            failed = await box.exec(["sh", "-c", "exit 7"])
            spaced = await box.exec(["printf", "%s|", "a b", "c"])
            return killed.exit_code, failed.exit_code, spaced.stdout

    assert asyncio.run(run()) == (128 + 15, 7, "a b|c|")


@needs_bwrap
def test_cli_exec_prints_one_json_line() -> None:
    result = run_agentrl("sandbox", "exec", "--timeout", "20", "--", "python3", "-c", "print(6 * 7)")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out == {"exit_code": 0, "stdout": "42\n", "stderr": "", "timed_out": False, "isolation": "bwrap"}
    timed = json.loads(run_agentrl("sandbox", "exec", "--timeout", "1", "--", "sleep 30; echo no").stdout)
    assert timed["timed_out"] is True
    assert timed["stdout"] == ""


def test_cli_exec_refuses_below_min_isolation() -> None:
    result = run_agentrl(
        "sandbox", "exec", "--isolation", "rlimits", "--min-isolation", "bwrap", "--", "true"
    )
    assert result.returncode == 3
    assert "min_isolation" in result.stderr
    assert result.stdout == ""


def test_cli_rejects_options_the_backend_does_not_have() -> None:
    result = run_agentrl("sandbox", "exec", "--backend", "docker", "--isolation", "bwrap", "--", "true")
    assert result.returncode == 2
    assert "--isolation does not apply to the docker backend" in result.stderr


def test_cli_info_reports_what_this_machine_offers() -> None:
    result = run_agentrl("sandbox", "info", env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["local"]["available"] == AVAILABLE
    assert info["docker"]["reachable"] is False and info["docker"]["why"]
