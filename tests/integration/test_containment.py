"""The containment suite for the escapes that used to work: hostile code in a real sandbox
races the host-side file API, fills the disk, and nests namespaces.

- symlink race: code in the sandbox flips `d` between a directory and a link to a host
  directory (holding a canary file of known content) as fast as it can, while the host calls
  `read_file("d/canary")` and `write_file("d/new-N")` hundreds of times: no canary byte may
  come back and no file may appear beside the canary;
- disk fill: writing until the disk is full stops at `disk_mb` with ENOSPC ("No space left
  on device"), the sandbox says the quota is full, and the host loses no more than that;
- nesting: `unshare -r -m` inside is refused by the seccomp filter (and works without it,
  which shows the filter is what refuses it); /proc/1/cmdline names no host path;
- host processes, environment secrets and ptrace of host PIDs are out of reach.

The race, the fill and the host-process checks run at each namespace level this machine has
(bubblewrap, and the `unshare` fallback); the seccomp case needs bubblewrap. The rest of the
contained cases (network, host files, writes outside, fork/memory/CPU bombs,
output floods, leftovers, concurrent sandboxes) live in tests/unit/envs/sandbox/
test_containment.py and, for Docker, tests/integration/test_sandbox_docker.py. The quota
needs root; the Docker half needs an engine this module can start (the fixture of
test_sandbox_docker.py, stopped by PID); each skips saying why.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agentrl.envs.sandbox import isolation
from agentrl.envs.sandbox.local import LocalSandbox
from tests.integration.test_sandbox_docker import config as docker_config
from tests.integration.test_sandbox_docker import docker_host  # noqa: F401  (the module-scoped engine)
from tests.unit.envs.sandbox.conftest import AVAILABLE, local_config, needs_bwrap

pytestmark = [pytest.mark.slow, pytest.mark.integration]
CANARY = b"agentrl host canary 7f3a: never readable from a sandbox\n"
TRIES = 300
LEVELS = [level for level in ("bwrap", "namespaces") if level in AVAILABLE]

# Runs inside the sandbox until /work/stop appears (or 60 s pass): swaps d between a real
# directory and a link to the host directory, counting the flips it made.
FLIPPER = """
import os, sys, time
host = sys.argv[1]
os.mkdir("d.real"); open("d.real/canary", "w").write("inside\\n"); os.symlink(host, "d.link")
open("ready", "w").close()
flips, end = 0, time.monotonic() + 60
while not os.path.exists("stop") and time.monotonic() < end:
    for source in ("d.real", "d.link"):
        try:
            os.rename(source, "d"); os.rename("d", source); flips += 1
        except OSError:
            pass
print(flips)
"""


@pytest.fixture
def host_dir(tmp_path: Path) -> Path:
    """A host directory outside any sandbox with the canary in it (world-traversable, so the
    sandbox uid could reach it if the host API ever followed a link there)."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "canary").write_bytes(CANARY)
    for path in (tmp_path, host):
        path.chmod(0o755)
    return host


async def race(box, host: Path, tries: int) -> dict[str, int]:
    """The flipper in the sandbox against `tries` host reads and writes; the outcome counts."""
    await box.write_file("flip.py", FLIPPER)
    flipper = asyncio.create_task(box.exec(["python3", "flip.py", str(host)], timeout=90))
    for _ in range(400):  # until the flipper has made its tree (another exec would end it)
        try:
            await box.read_file("ready")
            break
        except FileNotFoundError:
            await asyncio.sleep(0.05)
    counts = {"read": 0, "wrote": 0, "refused": 0}
    try:
        for i in range(tries):
            try:
                data = await box.read_file("d/canary")
                assert data != CANARY, f"try {i}: read_file returned the host canary"
                assert CANARY[:16] not in data
                counts["read"] += 1
            except (PermissionError, FileNotFoundError, NotADirectoryError):
                counts["refused"] += 1
            try:
                await box.write_file(f"d/new-{i}", b"x")
                counts["wrote"] += 1
            except (PermissionError, FileNotFoundError, NotADirectoryError, FileExistsError):
                counts["refused"] += 1
            assert sorted(p.name for p in host.iterdir()) == ["canary"], (
                f"try {i}: a file appeared on the host"
            )
    finally:
        await box.write_file("stop", b"")
        result = await flipper
    assert result.exit_code == 0, result.stderr
    counts["flips"] = int(result.stdout.strip() or 0)
    return counts


# --------------------------------------------------------------------------- local (bubblewrap)


@pytest.mark.parametrize("level", LEVELS)
async def test_symlink_race_against_read_file_and_write_file(level: str, host_dir: Path) -> None:
    box = LocalSandbox(local_config(level, timeout_s=120))
    await box.start()
    try:
        counts = await race(box, host_dir, TRIES)
    finally:
        await box.close()
    assert (host_dir / "canary").read_bytes() == CANARY
    assert sorted(p.name for p in host_dir.iterdir()) == ["canary"]
    assert counts["flips"] > 0 and counts["read"] + counts["wrote"] + counts["refused"] == 2 * TRIES, counts
    assert counts["refused"] > 0, f"the flipper never got in the way: the race was not run ({counts})"


@pytest.mark.parametrize("level", LEVELS[:1])
async def test_disk_fill_stops_at_the_quota(level: str) -> None:
    quota_mb = 64
    box = LocalSandbox(local_config(level, disk_mb=quota_mb, max_file_size_mb=16, timeout_s=60))
    await box.start()
    try:
        if box.quota is None:
            pytest.skip(f"no disk quota on this machine: {box.details['no_disk_quota']}")
        free_before = os.statvfs(box.quota.image or box.root).f_bavail * os.statvfs(box.root.parent).f_frsize
        code = (
            "import os\n"
            "n = 0\n"
            "try:\n"
            "    while n < 400:\n"  # 400 x 1 MiB: far past the quota; each file under the per-file limit
            "        with open(f'fill-{n}', 'wb') as f: f.write(os.urandom(1 << 20))\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print('stopped', n, e)\n"
        )
        fill = await box.exec(["python3", "-c", code])
        assert "No space left on device" in fill.stdout, fill
        assert int(fill.stdout.split()[1]) < quota_mb
        assert f"disk quota ({quota_mb} MiB) is full" in fill.stderr
        with pytest.raises(OSError, match="No space left"):
            await box.write_file("one-more.bin", os.urandom(4 << 20))
        used = (await box.exec("du -sm /work /tmp | awk '{s += $1} END {print s}'")).stdout.strip()
        assert int(used) <= quota_mb
        if box.quota.image is not None:  # the sparse image is all the host disk the sandbox used
            assert box.quota.image.stat().st_blocks * 512 <= (quota_mb + 1) << 20
        parent = os.statvfs(box.root.parent)
        lost = free_before - parent.f_bavail * parent.f_frsize
        # a shared machine's other writers are noise here; 20 GiB went missing before the quota
        assert lost < (quota_mb + 512) << 20, lost
        if level == "namespaces" or isolation._bwrap_has_size():  # memory-backed /dev/shm is bounded too
            shm = await box.exec("head -c 200000000 /dev/zero > /dev/shm/x; du -m /dev/shm/x; rm /dev/shm/x")
            assert "No space left on device" in shm.stderr, shm
            assert int(shm.stdout.split()[0]) <= isolation.DEV_SHM_MB
        await box.exec("rm -f fill-*")  # freeing space makes the sandbox usable again
        ok = await box.exec("echo fine > after.txt && cat after.txt")
        assert (ok.exit_code, ok.stdout) == (0, "fine\n"), ok
    finally:
        await box.close()


@needs_bwrap
async def test_nested_namespaces_are_refused_by_seccomp() -> None:
    nest = "unshare -r -m true && echo NESTED || echo refused"
    box = LocalSandbox(local_config())
    await box.start()
    try:
        assert box.details["seccomp"] is True
        result = await box.exec(nest)
        assert result.stdout.strip() == "refused" and "Operation not permitted" in result.stderr, result
        ctypes = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.unshare(0x10000000), ctypes.get_errno())"
        assert (await box.exec(["python3", "-c", ctypes])).stdout.split() == ["-1", "1"]  # EPERM
        cmdline = (await box.exec("tr '\\0' ' ' < /proc/1/cmdline")).stdout
        assert str(box.root) not in cmdline and "/tmp/agentrl-sandbox" not in cmdline, cmdline
    finally:
        await box.close()
    without = LocalSandbox(local_config(seccomp=False))  # the filter, not bwrap, is what refuses
    await without.start()
    try:
        assert (await without.exec(nest)).stdout.strip() == "NESTED"
    finally:
        await without.close()


@pytest.mark.parametrize("level", LEVELS)
async def test_host_processes_env_secrets_and_ptrace_are_out_of_reach(level: str, monkeypatch) -> None:
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "s3cr3t-value")
    box = LocalSandbox(local_config(level))
    await box.start()
    try:
        env = await box.exec("env")
        assert "s3cr3t-value" not in env.stdout
        pids = await box.exec("ls /proc | grep -E '^[0-9]+$'")
        assert len(pids.stdout.split()) < 10, pids.stdout  # its own few, not the host's hundreds
        seen = await box.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        assert "pytest" not in seen.stdout
        attach = (
            "import ctypes, sys; l = ctypes.CDLL(None, use_errno=True)\n"
            f"print(l.ptrace(16, {os.getpid()}, 0, 0), ctypes.get_errno())"  # PTRACE_ATTACH to us
        )
        result = await box.exec(["python3", "-c", attach])
        assert result.stdout.split()[0] == "-1", result  # ESRCH: the host's pids do not exist inside
    finally:
        await box.close()


# --------------------------------------------------------------------------- docker


async def test_docker_symlink_race(docker_host: str, host_dir: Path) -> None:  # noqa: F811
    """The archive API resolves inside the container: the link names a path that, seen from the
    container's root, is not the host's (fewer tries: each call is an HTTP round trip)."""
    from agentrl.envs.sandbox.docker import DockerSandbox

    box = DockerSandbox(docker_config(docker_host, timeout_s=120))
    await box.start()
    try:
        counts = await race(box, host_dir, 100)
    finally:
        await box.close()
    assert (host_dir / "canary").read_bytes() == CANARY
    assert sorted(p.name for p in host_dir.iterdir()) == ["canary"]
    assert counts["flips"] > 0, counts


async def test_docker_disk_quota_or_why_not(docker_host: str) -> None:  # noqa: F811
    from agentrl.envs.sandbox.docker import DockerSandbox

    box = DockerSandbox(docker_config(docker_host, disk_mb=64))
    await box.start()
    try:
        nested = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.unshare(0x10000000))"
        assert (await box.exec(["python3", "-c", nested])).stdout.strip() == "-1"  # Docker's seccomp
        if box.details["disk_quota"] is None:
            assert "disk quota" in box.details["no_disk_quota"]
            pytest.skip(f"this engine's storage driver has no quota: {box.details['no_disk_quota']}")
        fill = await box.exec(
            "i=0; while [ $i -lt 200 ]; do head -c 1048576 /dev/zero > f$i || break; i=$((i+1)); done; echo $i"
        )
        assert "No space left on device" in fill.stderr and int(fill.stdout.split()[-1]) < 64, fill
    finally:
        await box.close()
