"""The Docker sandbox: one container per sandbox, from a task's image, through the `docker` SDK.

The container runs a do-nothing PID 1 (a shell loop around `sleep`) and every `exec` is a
`docker exec` in it, so files persist between calls like a workstation. Containment:
`network_mode=none`, memory (no swap), CPU and pids limits, all capabilities dropped but
the few a root shell needs to manage its own files and processes, `no-new-privileges`,
core and file-size ulimits. After each exec — and at once on a timeout — `kill -9 -1`
inside the container ends every process but PID 1, so nothing outlives an exec, as with
the local backend. The container is removed on close.

Disk: `disk_mb` becomes the container's `storage_opt size` (a quota on its writable layer)
where the engine's storage driver supports one (overlay2 on xfs mounted with pquota,
btrfs, zfs, devicemapper); elsewhere Docker refuses the option, the container starts
without a quota and `details` says why (overlay2 on ext4, as on most hosts, has none).

Files: `read_file` / `write_file` go through Docker's archive API, which resolves the path
inside the container's own root — the engine runs each archive operation in a private
mount namespace switched to the container's filesystem (moby daemon/containerfs_linux.go,
v23+; a chroot'd helper since 19.03.1, the fix of CVE-2018-15664) — so a link planted in
the container can only lead to another file of the container, never to the host's.

Images come from sandboxes/ (Dockerfile.python, Dockerfile.swe) or a task's own image;
see sandboxes/README.md for building and importing them without a registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import posixpath
import tarfile
import uuid
from typing import TYPE_CHECKING, Any

from agentrl.envs.sandbox.base import (
    ExecResult,
    OutputCapture,
    Sandbox,
    SandboxError,
    local_directory,
    tar_directory,
)
from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.envs.sandbox.config import DockerSandboxConfig

logger = get_logger("envs.sandbox")

PID1 = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
KILL_ALL = ["/bin/sh", "-c", "kill -9 -1 2>/dev/null; true"]
CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID"]


class DockerSandbox(Sandbox):
    """A sandbox that is one container (see the module docstring)."""

    isolation = "docker"

    def __init__(self, config: DockerSandboxConfig) -> None:
        self.config = config
        self.workdir = config.workdir
        self.client: Any = None
        self.container: Any = None
        self.details: dict[str, object] = {}

    async def start(self, image_or_spec: str | None = None) -> None:
        if self.container is not None:
            raise SandboxError("sandbox already started")
        upload = local_directory(image_or_spec)
        await asyncio.to_thread(self._start, (None if upload else image_or_spec) or self.config.image)
        if upload:
            await asyncio.to_thread(self._upload, upload)

    def _upload(self, directory: str) -> None:
        ok = self.client.api.put_archive(self.container.id, self.workdir, tar_directory(directory))
        if not ok:
            raise SandboxError(f"cannot copy {directory} into the container")

    def _start(self, image: str) -> None:
        try:
            import docker
        except ImportError as exc:
            raise SandboxError(
                "the docker backend needs the docker SDK: pip install 'agentrl[docker]'"
            ) from exc

        cfg = self.config
        try:
            self.client = (
                docker.DockerClient(base_url=cfg.docker_host) if cfg.docker_host else docker.from_env()
            )
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise SandboxError(f"sandbox.docker_host: no Docker engine reachable: {exc}") from exc
        memory, fsize = f"{cfg.memory_mb}m", cfg.max_file_size_mb << 20
        try:  # never pull implicitly: tasks name images that must already be in the engine
            self.client.images.get(image)
        except docker.errors.ImageNotFound as exc:
            raise SandboxError(
                f"image {image!r} not found in the Docker engine; build, import or pull it first "
                "(see sandboxes/README.md)"
            ) from exc
        quota = {"size": f"{cfg.disk_mb}m"} if cfg.disk_mb else None
        self.details = {
            "isolation": "docker",
            "disk_quota": f"storage_opt {cfg.disk_mb} MiB" if quota else None,
        }
        try:
            try:
                self.container = self._run(image, memory, fsize, quota)
            except docker.errors.APIError as exc:
                if quota is None or "storage" not in str(exc.explanation or exc).lower():
                    raise
                why = f"the Docker engine has no per-container disk quota here: {exc.explanation or exc}"
                logger.warning("docker sandbox without a disk quota: %s", why)
                self.details.update(disk_quota=None, no_disk_quota=why)
                self.container = self._run(image, memory, fsize, None)
        except docker.errors.APIError as exc:
            raise SandboxError(f"cannot start a container from {image!r}: {exc.explanation or exc}") from exc
        logger.info("docker sandbox %s from %s (memory %s, pids %d, disk quota %s)", self.container.name,
                    image, memory, cfg.max_processes, self.details["disk_quota"])  # fmt: skip

    def _run(self, image: str, memory: str, fsize: int, storage_opt: dict[str, str] | None) -> Any:
        from docker.types import Ulimit

        cfg = self.config
        return self.client.containers.run(
            image,
            command=PID1,
            name=f"agentrl-sandbox-{uuid.uuid4().hex[:12]}",
            detach=True,
            network_mode="none",
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.max_processes,
            cap_drop=["ALL"],
            cap_add=CAPS,
            security_opt=["no-new-privileges"],
            ulimits=[Ulimit(name="core", soft=0, hard=0), Ulimit(name="fsize", soft=fsize, hard=fsize)],
            working_dir=cfg.workdir,
            labels={"agentrl.sandbox": "1"},
            **({"storage_opt": storage_opt} if storage_opt else {}),
        )

    async def close(self) -> None:
        if self.container is None:
            return
        container, self.container = self.container, None

        def remove() -> None:
            import docker

            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
            self.client.close()

        await asyncio.to_thread(remove)

    # ------------------------------------------------------------------ exec

    def _api(self) -> Any:
        if self.container is None:
            raise SandboxError("sandbox not started")
        return self.client.api

    async def _kill_all(self) -> None:
        api = self._api()
        exec_id = await asyncio.to_thread(api.exec_create, self.container.id, KILL_ALL, user="root")
        await asyncio.to_thread(api.exec_start, exec_id["Id"])

    async def exec(
        self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        api = self._api()
        timeout = timeout or self.config.timeout_s
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        created = await asyncio.to_thread(
            api.exec_create, self.container.id, argv, environment=env or {}, workdir=self.workdir
        )
        exec_id = created["Id"]
        out, err = OutputCapture(self.config.max_output_bytes), OutputCapture(self.config.max_output_bytes)

        def pump() -> None:
            for stdout, stderr in api.exec_start(exec_id, stream=True, demux=True):
                if stdout:
                    out.feed(stdout)
                if stderr:
                    err.feed(stderr)

        reader = asyncio.ensure_future(asyncio.to_thread(pump))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout)
        except asyncio.TimeoutError:
            timed_out = True
        await self._kill_all()  # the timed-out tree, and anything the command left running
        await asyncio.wait_for(reader, 30)
        code = (await asyncio.to_thread(api.exec_inspect, exec_id))["ExitCode"]
        if code is None:
            code = 137
        stderr = err.text()
        if timed_out:
            stderr += f"\n[sandbox: timed out after {timeout:g}s; process tree killed]"
        return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, timed_out=timed_out)

    # ------------------------------------------------------------------ files

    def _path(self, path: str) -> str:
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))

    async def write_file(self, path: str, data: str | bytes) -> None:
        payload = data.encode() if isinstance(data, str) else data
        full = self._path(path)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(full.lstrip("/"))
            info.size, info.mode = len(payload), 0o644
            tar.addfile(info, io.BytesIO(payload))
        import docker

        try:
            ok = await asyncio.to_thread(self._api().put_archive, self.container.id, "/", buffer.getvalue())
        except docker.errors.APIError as exc:  # e.g. a directory on the path vanished meanwhile
            raise _os_error(full, exc) from None
        if not ok:
            raise SandboxError(f"write_file {path}: the Docker engine refused the archive")

    async def read_file(self, path: str) -> bytes:
        import docker

        full = self._path(path)
        limit = self.config.max_file_size_mb << 20

        def read() -> bytes:
            try:
                stream, stat = self._api().get_archive(self.container.id, full)
            except docker.errors.NotFound as exc:
                raise FileNotFoundError(full) from exc
            except docker.errors.APIError as exc:
                raise _os_error(full, exc) from None
            if stat.get("mode", 0) & (1 << 31):  # Go's os.ModeDir
                raise IsADirectoryError(full)
            if stat.get("size", 0) > limit:
                raise PermissionError(f"{full}: larger than the {limit}-byte read limit")
            try:
                with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                    member = tar.next()
                    extracted = tar.extractfile(member) if member else None
                    if extracted is None:
                        raise FileNotFoundError(f"{full}: not a regular file")
                    return extracted.read()
            except tarfile.TarError as exc:  # the engine's stream was cut: the path vanished mid-read
                raise FileNotFoundError(f"{full}: changed while it was read ({exc})") from None

        return await asyncio.to_thread(read)


def _os_error(path: str, exc: Any) -> OSError:
    """The engine's refusal of an archive operation as the OSError the file API promises."""
    text = str(exc.explanation or exc)
    for marker, kind in (("no such file", FileNotFoundError), ("not a directory", NotADirectoryError)):
        if marker in text.lower():
            return kind(f"{path}: {text}")
    return PermissionError(f"{path}: the Docker engine refused: {text}")
