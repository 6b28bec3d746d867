"""The local sandbox: model-written code as a process tree on this machine, contained.

Each sandbox owns a fresh host directory (`<root>/work`, `<root>/tmp`) — a mount of its
own with a size limit when started as root (`disk.py`: the disk quota). Each `exec`
starts one process tree in it under the strongest isolation the machine gives
(`isolation.py` builds the argv):

- `bwrap`: bubblewrap with new user, pid, net, ipc, uts and mount namespaces, a filesystem
  made only of read-only /usr (and the /bin, /lib* links), a few /etc files, /proc, /dev,
  and the sandbox's own `/work` and `/tmp`; a seccomp filter (`seccomp.py`) refuses new
  namespaces and mounts to the code inside.
- `namespaces`: `unshare` (user, pid, net, ipc, uts, mount) and `chroot` into the same
  view, built by a shell script; no seccomp filter (nothing to load one with).
- `rlimits`: a plain process with resource limits only (trusted code), at host paths.

On top of any of them: rlimits (CPU, file size, processes, address space), a cgroup
(memory + pids) where one can be made, a private uid when started as root, and a
wall-clock timeout after which the whole tree is killed. When the command's main
process ends, everything it left behind is killed too: nothing outlives an `exec`.
`start()` logs which isolation it got and refuses to go below `min_isolation`.

`read_file` / `write_file` work on the host while sandboxed code may run, so they go
through `hostfs.py`: beneath descriptors of work/ and tmp/ held for the sandbox's life,
never following a link (the sandbox cannot race them into a host file)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import posixpath
import random
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.envs.sandbox import hostfs, seccomp
from agentrl.envs.sandbox.base import ExecResult, OutputCapture, Sandbox, SandboxError, isolation_at_least
from agentrl.envs.sandbox.disk import DiskQuota
from agentrl.envs.sandbox.isolation import (
    NEWROOT,
    SITE_INSIDE,
    available_isolation,
    bwrap_options,
    namespaces_prefix,
)
from agentrl.envs.sandbox.limits import Cgroup, Limits, kill_uid, launcher, pids_of_uid, threads_of_uid
from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.envs.sandbox.config import LocalSandboxConfig

logger = get_logger("envs.sandbox")

PROJECT_ROOT = Path(__file__).resolve().parents[3]
_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()
_uid_rotation = itertools.count()


def _allocate_uid() -> int:
    """A private uid for a sandbox started by root: unused by this process's other sandboxes and
    by any running process. Each process tries its own block first (by pid), so rollers on one
    host rarely even look at the same uids."""
    block = 200_000 + (os.getpid() % 7000) * 100
    start = next(_uid_rotation) % 100  # rotate: a just-closed sandbox's uid may still own dying processes
    own = [block + (start + i) % 100 for i in range(100)]
    candidates = [*own, *random.sample(range(200_000, 900_000), 200)]
    with _uid_lock:  # sandboxes start concurrently, each in a worker thread
        for uid in candidates:
            if uid not in _uids_in_use and not pids_of_uid(uid):
                _uids_in_use.add(uid)
                return uid
    raise SandboxError("no free uid for a sandbox (300 tried)")


def _memfd(name: str, data: bytes) -> int:
    """An inheritable descriptor reading `data` from its start (bwrap's --args and --seccomp)."""
    fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: the launcher chain passes it down to bwrap
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _check_traversable(root: Path, uid: int) -> None:
    """The private uid must be able to reach its work dir through `root` and its parents (bwrap
    binds it as that uid); say so at start rather than fail later with bwrap's "Permission denied"."""
    for directory in [root.resolve(), *root.resolve().parents]:
        st = directory.stat()
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            raise SandboxError(
                f"sandbox.root_dir: {directory} is not traversable by the sandbox's uid {uid} "
                "(needs o+x on it and every parent); choose another directory or leave root_dir unset"
            )


class LocalSandbox(Sandbox):
    """A sandbox made of processes on this machine (see the module docstring)."""

    def __init__(self, config: LocalSandboxConfig) -> None:
        self.config = config
        self.limits = Limits(
            config.memory_mb, config.max_processes, config.cpu_time_s, config.max_file_size_mb
        )
        self.root: Path | None = None
        self.cgroup: Cgroup | None = None
        self.quota: DiskQuota | None = None
        self.uid: int | None = None
        self.isolation = "none"
        self.details: dict[str, object] = {}
        self.site: Path | None = None
        self._dir_fds: dict[str, int] = {}
        self._seccomp = seccomp.program() if config.seccomp else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, image_or_spec: str | None = None) -> None:
        """Create the working directory (a copy of `image_or_spec` when it names a host
        directory), choose the isolation, and refuse when it is below `min_isolation`."""
        if self.root is not None:
            raise SandboxError("sandbox already started")
        cfg = self.config
        if os.geteuid() == 0:
            self.uid = cfg.uid or await asyncio.to_thread(_allocate_uid)
        try:
            await self._start(image_or_spec)
        except BaseException:
            await self.close()
            raise

    async def _start(self, image_or_spec: str | None) -> None:
        """Isolation level, host directories (with the disk quota), cgroup: in that order, so a
        sandbox that cannot be isolated as asked creates nothing."""
        cfg = self.config
        level = self.isolation = await self._choose_isolation()
        if cfg.python_packages:
            from agentrl.envs.sandbox.pypkgs import site_dir

            try:
                self.site = await asyncio.to_thread(site_dir, cfg.python_packages)
            except ValueError as exc:
                raise SandboxError(str(exc)) from None
        why_no_quota = await self._lay_out(image_or_spec)
        inside = level in ("bwrap", "namespaces")
        self.workdir = cfg.workdir if inside else str(self.root / "work")
        self.tmpdir = "/tmp" if inside else str(self.root / "tmp")
        if level != "none":
            self.cgroup = Cgroup.create(self.limits)
        self.details = {
            "isolation": level,
            "uid": self.uid if self.uid is not None else os.getuid(),
            "cgroup": f"v{self.cgroup.version}" if self.cgroup else None,
            "network": level == "rlimits" or level == "none",
            "memory_limit": "cgroup" if self.cgroup else ("rlimit_as" if level != "none" else None),
            "disk_quota": self.quota.describe() if self.quota else None,
            "seccomp": level == "bwrap" and self._seccomp is not None,
        }
        if self.quota is None:
            self.details["no_disk_quota"] = why_no_quota
        logger.info("local sandbox %s: %s", self.root.name, self.details)

    async def _choose_isolation(self) -> str:
        """`sandbox.isolation` (`auto`: the strongest available), refused when unavailable here or
        below `sandbox.min_isolation`."""
        cfg = self.config
        available = await asyncio.to_thread(available_isolation, self.uid)
        level = available[0] if cfg.isolation == "auto" else cfg.isolation
        if level not in available:
            raise SandboxError(
                f"sandbox.isolation={level!r} is not available here (available: {', '.join(available)}); "
                "install bubblewrap (apt-get install -y bubblewrap) or lower sandbox.isolation"
            )
        if not isolation_at_least(level, cfg.min_isolation):
            raise SandboxError(
                f"sandbox isolation {level!r} is below sandbox.min_isolation={cfg.min_isolation!r}: refusing "
                f"to run untrusted code (available here: {', '.join(available)})"
            )
        return level

    async def _lay_out(self, image_or_spec: str | None) -> str:
        """The sandbox's host directory (on its quota filesystem when `disk_mb`) with `work/` (a copy
        of `image_or_spec`, a directory, if given) and `tmp/` owned by the sandbox uid, and
        descriptors held on both; why there is no disk quota, if there is none."""
        cfg = self.config
        if cfg.root_dir:
            Path(cfg.root_dir).mkdir(parents=True, exist_ok=True)
            if self.uid is not None:
                _check_traversable(Path(cfg.root_dir), self.uid)
        self.root = Path(tempfile.mkdtemp(prefix="agentrl-sandbox-", dir=cfg.root_dir))
        why_no_quota = "sandbox.disk_mb is 0"
        if cfg.disk_mb:
            self.quota, why_no_quota = await asyncio.to_thread(DiskQuota.mount, self.root, cfg.disk_mb)
            if self.quota is None:
                logger.warning("local sandbox without a disk quota: %s", why_no_quota)
        if self.uid is not None:
            os.chmod(self.root, 0o755)  # the sandbox uid passes through; it owns only work/ and tmp/
        work, tmp = self.root / "work", self.root / "tmp"
        try:
            if image_or_spec:
                source = Path(image_or_spec)
                if not source.is_dir():
                    raise SandboxError(f"local sandbox: {image_or_spec!r} is not a directory to copy in")
                await asyncio.to_thread(shutil.copytree, source, work, symlinks=True)
            else:
                work.mkdir()
            tmp.mkdir()
            (self.root / NEWROOT).mkdir()
        except OSError as exc:  # shutil.Error included: e.g. a snapshot larger than the quota
            raise SandboxError(f"local sandbox: cannot lay out {self.root}: {exc}") from None
        if self.uid is not None:
            await asyncio.to_thread(self._chown_tree, work)
            await asyncio.to_thread(self._chown_tree, tmp)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        self._dir_fds = {"work": os.open(work, flags), "tmp": os.open(tmp, flags)}
        return why_no_quota

    async def close(self) -> None:
        await asyncio.to_thread(self._kill_all)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None
        for fd in self._dir_fds.values():
            os.close(fd)
        self._dir_fds = {}
        if self.quota is not None:
            await asyncio.to_thread(self.quota.unmount)
            self.quota = None
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            self.root = None
        if self.uid is not None:  # forget it: another sandbox may be given this uid next
            with _uid_lock:
                _uids_in_use.discard(self.uid)
            self.uid = None

    def _chown_tree(self, top: Path) -> None:
        """Give a tree the host just made to the sandbox uid (before any sandboxed code runs)."""
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.lchown(name, self.uid, self.uid)

    def _kill_all(self, proc: asyncio.subprocess.Process | None = None) -> None:
        """Kill every process the sandbox may have left: its session, its cgroup, its uid."""
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.uid is not None:
            kill_uid(self.uid)

    # ------------------------------------------------------------------ exec

    def _argv(self, cmd: str | list[str], fds: list[int]) -> tuple[list[str], str]:
        """The command under this sandbox's isolation, and the host directory it starts in.
        Descriptors it needs passed down are appended to `fds` (the caller closes them)."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        work, tmp = str(self.root / "work"), str(self.root / "tmp")
        site = str(self.site) if self.site else None
        cfg = self.config
        if self.isolation == "bwrap":
            seccomp_fd = None
            if self._seccomp is not None:
                seccomp_fd = _memfd("agentrl-seccomp", self._seccomp)
                fds.append(seccomp_fd)
            options = bwrap_options(work, tmp, cfg.workdir, cfg.ro_paths, site, seccomp_fd)
            args_fd = _memfd("agentrl-bwrap-args", b"".join(os.fsencode(a) + b"\0" for a in options))
            fds.append(args_fd)
            return ["bwrap", "--args", str(args_fd), "--", *argv], work
        if self.isolation == "namespaces":
            return namespaces_prefix(cfg.workdir, cfg.ro_paths, site) + argv, str(self.root)
        return argv, work

    def _nproc(self) -> int | None:
        if self.isolation == "none":
            return None
        if self.uid is not None:
            return self.config.max_processes
        # our uid is shared with the host's own processes: allow what already runs, plus the budget
        return threads_of_uid(os.getuid()) + self.config.max_processes

    def _disk_full(self) -> bool:
        """Whether the quota is (all but) used up: under 1 MiB left, a write of any size failed."""
        if self.quota is None or self.root is None:
            return False
        with contextlib.suppress(OSError):
            st = os.statvfs(self.root)
            return st.f_bavail * st.f_frsize < 1 << 20
        return False

    async def exec(
        self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        if self.root is None:
            raise SandboxError("sandbox not started")
        timeout = timeout or self.config.timeout_s
        full_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": self.tmpdir,
            "LANG": "C.UTF-8",
            **(env or {}),
        }
        if self.site is not None:
            inside = self.isolation in ("bwrap", "namespaces")
            site = SITE_INSIDE if inside else str(self.site)
            full_env["PYTHONPATH"] = ":".join(p for p in (full_env.get("PYTHONPATH"), site) if p)
        limits = self.limits if self.isolation != "none" else None
        oom_before = self.cgroup.oom_kills() if self.cgroup else 0
        limiter = launcher(limits, self.cgroup, self.uid, self._nproc())
        fds: list[int] = []
        try:
            argv, cwd = self._argv(cmd, fds)
            proc = await asyncio.create_subprocess_exec(
                *limiter,
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=full_env,
                start_new_session=True,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        out, err = OutputCapture(self.config.max_output_bytes), OutputCapture(self.config.max_output_bytes)
        pumps = [asyncio.create_task(_pump(proc.stdout, out)), asyncio.create_task(_pump(proc.stderr, err))]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            await asyncio.to_thread(self._kill_all, proc)
            await proc.wait()
            await asyncio.wait(pumps, timeout=10)
            for task in pumps:
                task.cancel()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        stderr = err.text()
        if self.cgroup and self.cgroup.oom_kills() > oom_before:
            stderr += "\n[sandbox: a process was killed for exceeding the memory limit]"
        if self._disk_full():
            stderr += (
                f"\n[sandbox: the disk quota ({self.config.disk_mb} MiB) is full: No space left on device]"
            )
        if timed_out:
            stderr += f"\n[sandbox: timed out after {timeout:g}s; process tree killed]"
        return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, timed_out=timed_out)

    # ------------------------------------------------------------------ files

    def _locate(self, path: str) -> tuple[int, str]:
        """The held directory descriptor (work/ or tmp/) a sandbox path lies beneath, and the
        path relative to it; anything outside both is refused. Nothing is resolved here:
        hostfs opens it beneath the descriptor without following a link."""
        if self.root is None or not self._dir_fds:
            raise SandboxError("sandbox not started")
        p = posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))
        for base, key in ((self.tmpdir, "tmp"), (self.workdir, "work")):
            if p == base or p.startswith(base.rstrip("/") + "/"):
                return self._dir_fds[key], posixpath.relpath(p, base)
        raise PermissionError(f"{path}: outside the sandbox's writable directories")

    async def write_file(self, path: str, data: str | bytes) -> None:
        fd, relative = self._locate(path)
        payload = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(hostfs.write_beneath, fd, relative, payload, self.uid)

    async def read_file(self, path: str) -> bytes:
        fd, relative = self._locate(path)
        return await asyncio.to_thread(hostfs.read_beneath, fd, relative, self.config.max_file_size_mb << 20)


async def _pump(stream: asyncio.StreamReader | None, capture: OutputCapture) -> None:
    """Read a pipe to its end, keeping only what the capture holds (the child never blocks)."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        capture.feed(chunk)
