"""The Docker sandbox against a real Docker engine that this module starts (and stops by PID).

No registry here: the test image is a root filesystem made from the host's own shell,
coreutils and Python (sandboxes/host_rootfs.py) and `docker import`ed. Skips, with the
reason, only where no engine can be started (not root, dockerd not installed, or it
fails to come up)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.config import DockerSandboxConfig
from agentrl.envs.sandbox import SandboxError, create
from agentrl.envs.sandbox.docker import DockerSandbox
from tests.conftest import REPO, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]
IMAGE = "agentrl/host-python:test"


def _skip(reason: str) -> None:
    pytest.skip(f"no Docker engine can be started here: {reason}")


@pytest.fixture(scope="module")
def docker_host() -> Iterator[str]:
    """A private dockerd (no bridge, no iptables) with the test image imported; yields its URL."""
    docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")
    if os.geteuid() != 0:
        _skip("starting dockerd needs root")
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        _skip("dockerd is not installed (apt-get install -y docker.io)")
    root = Path(tempfile.mkdtemp(prefix="agentrl-docker-", dir="/tmp"))  # short: socket paths live here
    url = f"unix://{root}/docker.sock"
    log = (root / "dockerd.log").open("w")
    args = ["--iptables=false", "--ip-forward=false", "--bridge=none", "--data-root", str(root / "data"),
            "--exec-root", str(root / "x"), "--pidfile", str(root / "docker.pid"), "-H", url]  # fmt: skip
    proc = subprocess.Popen([dockerd, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client = docker.DockerClient(base_url=url)
                client.ping()
                break
            except docker.errors.DockerException:
                client = None
                time.sleep(0.3)
        if client is None:
            tail = (root / "dockerd.log").read_text()[-800:]
            _skip(f"dockerd did not come up (exit {proc.poll()}): {tail}")
        tarball = root / "rootfs.tar"
        subprocess.run([sys.executable, str(REPO / "sandboxes" / "host_rootfs.py"), str(tarball), "--python"],
                       check=True, capture_output=True)  # fmt: skip
        client.api.import_image(src=str(tarball), repository=IMAGE.split(":")[0], tag=IMAGE.split(":")[1])
        client.close()
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def config(docker_host: str, **kwargs) -> DockerSandboxConfig:
    defaults = {"image": IMAGE, "memory_mb": 128, "max_processes": 32, "max_output_bytes": 4096}
    return DockerSandboxConfig(docker_host=docker_host, **{**defaults, **kwargs})


def container_processes(box: DockerSandbox) -> list[str]:
    return [row[-1] for row in box.container.top()["Processes"]]


async def test_files_exec_and_removal(docker_host: str) -> None:
    box = create(config(docker_host))
    await box.start()
    name = box.container.name
    assert box.isolation == "docker"
    await box.write_file("pkg/mod.py", "VALUE = 41\n")
    result = await box.exec(
        ["python3", "-c", "import sys; sys.path.insert(0, 'pkg'); import mod; print(mod.VALUE + 1)"]
    )
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "42\n", False)
    await box.exec("echo more >> pkg/mod.py")
    assert await box.read_file("/work/pkg/mod.py") == b"VALUE = 41\nmore\n"
    with pytest.raises(FileNotFoundError):
        await box.read_file("missing.txt")
    assert (await box.exec(["sh", "-c", "exit 7"])).exit_code == 7
    await box.close()
    await box.close()
    import docker

    client = docker.DockerClient(base_url=docker_host)
    assert [c.name for c in client.containers.list(all=True)] == []
    assert name
    client.close()


async def test_unknown_image_is_a_clear_error(docker_host: str) -> None:
    box = create(config(docker_host, image="agentrl/no-such-image:1"))
    with pytest.raises(SandboxError, match="not found"):
        await box.start()


async def test_containment(docker_host: str) -> None:
    box = DockerSandbox(config(docker_host, max_processes=24, max_file_size_mb=1))
    await box.start()
    try:
        code = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2); print('CONNECTED')"
        net = await box.exec(["python3", "-c", code])
        assert net.exit_code != 0 and "CONNECTED" not in net.stdout
        secrets = await box.exec(f"cat /root/.ssh/id_rsa {REPO}/pyproject.toml")
        assert secrets.exit_code != 0 and secrets.stdout == ""
        assert (await box.exec("echo x > /proc/sys/kernel/hostname")).exit_code != 0

        bomb = await box.exec("bomb() { bomb | bomb & }; bomb; wait", timeout=10)
        assert bomb.timed_out or "fork" in bomb.stderr.lower()
        hog = await box.exec(["python3", "-c", "x = bytearray(1 << 30); print('survived')"])
        assert hog.exit_code == 137 and "survived" not in hog.stdout

        loop = await box.exec("sleep 777 & (sleep 778 &); while :; do :; done", timeout=2)
        assert loop.timed_out and loop.exit_code != 0
        leftovers = await box.exec("sleep 779 & echo started")
        assert leftovers.stdout == "started\n"
        assert not [cmd for cmd in container_processes(box) if "sleep 77" in cmd]

        flood = await box.exec(["python3", "-c", "print('a' * (10 << 20) + 'END')"])
        assert flood.exit_code == 0 and "truncated" in flood.stdout and flood.stdout.endswith("END\n")
        assert len(flood.stdout) < 4096 + 100

        big = await box.exec("head -c 5000000 /dev/zero > big.bin; stat -c %s big.bin")
        assert big.stdout.strip() == str(1 << 20)

        alive = await box.exec("echo alive")
        assert (alive.exit_code, alive.stdout) == (0, "alive\n")
    finally:
        await box.close()


def test_cli_exec_with_docker_backend(docker_host: str) -> None:
    result = run_agentrl(
        "sandbox", "exec", "--backend", "docker", "--image", IMAGE, "--", "python3", "-c", "print(2 + 2)",
        env={"DOCKER_HOST": docker_host},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out == {"exit_code": 0, "stdout": "4\n", "stderr": "", "timed_out": False, "isolation": "docker"}
    info = json.loads(run_agentrl("sandbox", "info", env={"DOCKER_HOST": docker_host}).stdout)
    assert info["docker"]["reachable"] is True


@pytest.fixture(scope="module")
def swe_base(docker_host: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Dockerfile.python and Dockerfile.swe built FROM the imported host image, offline."""
    import docker

    context = tmp_path_factory.mktemp("context") / "sandboxes"
    shutil.copytree(REPO / "sandboxes", context)
    subprocess.run([sys.executable, str(context / "vendor.py"), "collect", str(context / "vendor"), "pytest"],
                   check=True, capture_output=True)  # fmt: skip
    client = docker.DockerClient(base_url=docker_host)
    try:
        client.images.build(path=str(context), dockerfile="Dockerfile.python", buildargs={"BASE": IMAGE},
                            tag="agentrl/python-sandbox:test", rm=True)  # fmt: skip
        client.images.build(path=str(context), dockerfile="Dockerfile.swe", tag="agentrl/swe-base:test",
                            buildargs={"BASE": "agentrl/python-sandbox:test"}, rm=True)  # fmt: skip
    except docker.errors.BuildError as exc:
        log = "".join(str(chunk.get("stream", chunk)) for chunk in exc.build_log)
        raise AssertionError(f"image build failed: {exc}\n{log[-3000:]}") from None
    finally:
        client.close()
    return "agentrl/swe-base:test"


async def test_dockerfiles_build_without_a_registry(docker_host: str, swe_base: str) -> None:
    """The SWE base built from sandboxes/ runs a repository's tests with pytest and diffs with git."""
    async with create(config(docker_host, image=swe_base, memory_mb=256)) as box:
        await box.write_file("calc.py", "def add(a, b):\n    return a - b\n")
        await box.write_file(
            "test_calc.py", "from calc import add\n\ndef test_add():\n    assert add(2, 2) == 4\n"
        )
        failing = await box.exec("git init -q . && git add -A && python3 -m pytest -q test_calc.py")
        assert failing.exit_code == 1, failing.stdout + failing.stderr
        await box.exec("sed -i 's/a - b/a + b/' calc.py")
        diff = await box.exec("git diff")
        assert "+    return a + b" in diff.stdout
        passing = await box.exec("python3 -m pytest -q test_calc.py")
        assert passing.exit_code == 0, passing.stdout + passing.stderr
        assert "1 passed" in passing.stdout


def build_task_image(docker_host: str, swe_base: str, repo_dir: str | Path, context: Path, tag: str) -> None:
    """A task's own image, as SWE-bench ships them: the base image with the repository at /testbed."""
    import docker

    shutil.copytree(repo_dir, context / "repo")
    (context / "Dockerfile").write_text(f"FROM {swe_base}\nCOPY repo/ /testbed/\nWORKDIR /testbed\n")
    client = docker.DockerClient(base_url=docker_host)
    try:
        client.images.build(path=str(context), tag=tag, rm=True)
    finally:
        client.close()


async def test_swe_task_graded_in_its_own_image(docker_host: str, swe_base: str, tmp_path: Path) -> None:
    """A synthetic task baked into an image FROM the SWE base: the right patch scores 1, none 0."""
    import dataclasses

    from agentrl.envs.swe.grading import grade_patch
    from agentrl.envs.swe.synthetic import generate

    [task] = generate(tmp_path / "tasks", 1, seed=5)
    build_task_image(docker_host, swe_base, task.repo_dir, tmp_path / "task-image", "agentrl/task-test:1")
    in_image = dataclasses.replace(task, image="agentrl/task-test:1", repo_dir=None, workdir="/testbed")
    sandbox = config(docker_host, memory_mb=256)
    assert (await grade_patch(sandbox, in_image, task.patch, timeout=60)).reward == 1.0
    unfixed = await grade_patch(sandbox, in_image, "", timeout=60)
    assert unfixed.reward == 0.0 and all(unfixed.pass_to_pass.values())
    # no task image: the snapshot is copied into a container of the default image
    uploaded = config(docker_host, memory_mb=256, image=swe_base)
    assert (await grade_patch(uploaded, task, task.patch, timeout=60)).reward == 1.0
