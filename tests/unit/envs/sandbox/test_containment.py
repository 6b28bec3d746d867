"""The containment suite: hostile code against the local sandbox under bubblewrap.

Each test runs something a model might write on purpose or by accident — reach the
network, read secrets, write outside, fork-bomb, eat memory, spin forever, flood
output — and checks it is contained, reported, and that the sandbox keeps working."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from agentrl.envs.sandbox.limits import pids_of_uid
from agentrl.envs.sandbox.local import PROJECT_ROOT, LocalSandbox
from tests.unit.envs.sandbox.conftest import local_config, needs_bwrap, processes_with

pytestmark = needs_bwrap


async def still_works(box: LocalSandbox) -> None:
    result = await box.exec("echo alive")
    assert (result.exit_code, result.stdout) == (0, "alive\n")


async def test_reports_bwrap_isolation(box: LocalSandbox) -> None:
    assert box.isolation == "bwrap"
    assert box.details["network"] is False
    result = await box.exec("ls /")
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "work"}
    assert set(result.stdout.split()) <= allowed


async def test_network_is_unreachable_even_to_host_loopback(box: LocalSandbox) -> None:
    with socket.socket() as server:  # a real listener on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
            "    except OSError as e:\n"
            "        print('BLOCKED', addr, e)\n"
        )
        result = await box.exec(["python3", "-c", code])
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("BLOCKED") == 2
    await still_works(box)


async def test_host_secrets_and_project_are_invisible(box: LocalSandbox) -> None:
    for path in ["/root", "/home", str(PROJECT_ROOT), str(PROJECT_ROOT / "pyproject.toml"), "/etc/shadow"]:
        result = await box.exec(["cat", path])
        assert result.exit_code != 0, path
        assert result.stdout == ""


async def test_writing_outside_the_sandbox_fails(box: LocalSandbox, tmp_path: Path) -> None:
    for target in ["/usr/evil", "/etc/evil", "/evil", "/proc/sys/kernel/hostname"]:
        result = await box.exec(f"echo x > {target}")
        assert result.exit_code != 0, target
        assert not Path(target).exists() or target.startswith("/proc")
    with pytest.raises(PermissionError):
        await box.write_file("/etc/evil", "x")
    with pytest.raises(PermissionError):
        await box.write_file("../../escape", "x")
    # a symlink the sandboxed code plants must not lead the host-side file API outside
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    await box.exec(f"ln -s {secret} link && ln -s {tmp_path} dirlink")
    with pytest.raises(PermissionError):
        await box.read_file("link")
    with pytest.raises(PermissionError):
        await box.write_file("dirlink/new.txt", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]
    await still_works(box)


async def test_fork_bomb_is_contained() -> None:
    box = LocalSandbox(local_config(max_processes=24))
    await box.start()
    try:
        result = await box.exec("bomb() { bomb | bomb & }; bomb; wait", timeout=5)
        # the bomb runs into the process limit (fork fails), then its whole tree is killed
        stderr = result.stderr.lower()
        assert result.timed_out or "fork" in stderr or "resource" in stderr, result
        if box.uid is not None:
            assert pids_of_uid(box.uid) == [], result
        await still_works(box)
    finally:
        await box.close()


async def test_memory_hog_is_killed() -> None:
    box = LocalSandbox(local_config(memory_mb=128))
    await box.start()
    try:
        result = await box.exec(["python3", "-c", "x = bytearray(1 << 30); print('survived')"])
        assert result.exit_code != 0
        assert "survived" not in result.stdout
        if box.cgroup is not None:
            assert result.exit_code == 137
            assert "memory limit" in result.stderr
        await still_works(box)
    finally:
        await box.close()


async def test_infinite_loop_times_out_and_the_whole_tree_dies(box: LocalSandbox) -> None:
    marker = "4242.25"
    cmd = f"sleep {marker} & (setsid sleep {marker} &) ; sh -c 'sleep {marker}' & while :; do :; done"
    result = await box.exec(cmd, timeout=2)
    assert result.timed_out
    assert result.exit_code != 0
    assert "timed out" in result.stderr
    assert processes_with(f"sleep {marker}") == []
    await still_works(box)


async def test_background_processes_do_not_outlive_exec(box: LocalSandbox) -> None:
    marker = "4343.5"
    result = await box.exec(f"(setsid sleep {marker} &); nohup sleep {marker} >/dev/null 2>&1 & echo started")
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "started\n", False)
    assert processes_with(f"sleep {marker}") == []


async def test_huge_output_is_truncated_with_a_marker(box: LocalSandbox) -> None:
    code = (
        "import sys; sys.stdout.write('a' * 1000 + 'b' * (20 << 20) + 'END'); sys.stderr.write('e' * 100000)"
    )
    result = await box.exec(["python3", "-c", code])
    assert result.exit_code == 0
    limit = box.config.max_output_bytes
    assert result.stdout.startswith("a" * 1000)
    assert result.stdout.endswith("END")
    assert "truncated" in result.stdout
    assert len(result.stdout) < limit + 100
    assert len(result.stderr) < limit + 100


async def test_cpu_time_and_file_size_limits() -> None:
    box = LocalSandbox(local_config(cpu_time_s=1, max_file_size_mb=1))
    await box.start()
    try:
        spin = await box.exec(["python3", "-c", "while True: pass"], timeout=60)
        assert not spin.timed_out
        assert spin.exit_code in (128 + 9, 128 + 24)  # SIGKILL or SIGXCPU
        big = await box.exec("head -c 5000000 /dev/zero > big.bin")
        assert big.exit_code != 0
        assert (await box.exec("stat -c %s big.bin")).stdout.strip() == str(1 << 20)
    finally:
        await box.close()


async def test_concurrent_sandboxes_do_not_see_each_other() -> None:
    boxes = [LocalSandbox(local_config()) for _ in range(3)]
    await asyncio.gather(*(b.start() for b in boxes))
    try:
        await asyncio.gather(*(b.write_file("id.txt", str(i)) for i, b in enumerate(boxes)))
        await asyncio.gather(*(b.exec(f"echo {i} > /tmp/mine") for i, b in enumerate(boxes)))
        results = await asyncio.gather(*(b.exec("cat id.txt; echo; cat /tmp/*") for b in boxes))
        assert [r.stdout.split() for r in results] == [["0", "0"], ["1", "1"], ["2", "2"]]
    finally:
        await asyncio.gather(*(b.close() for b in boxes))


async def test_close_leaves_no_process_cgroup_or_directory() -> None:
    box = LocalSandbox(local_config())
    await box.start()
    root, cgroup, uid = box.root, box.cgroup, box.uid
    marker = "6161.5"
    # run an exec that is still going when close() is called from elsewhere
    running = asyncio.create_task(box.exec(f"sleep {marker} & sleep {marker}", timeout=60))
    for _ in range(100):
        if processes_with(f"sleep {marker}"):
            break
        await asyncio.sleep(0.05)
    assert processes_with(f"sleep {marker}")
    await box.close()
    result = await running
    assert result.exit_code != 0
    assert processes_with(f"sleep {marker}") == []
    assert not root.exists()
    if uid is not None:
        assert pids_of_uid(uid) == []
    if cgroup is not None:
        assert not any(d.exists() for d in cgroup.dirs)
