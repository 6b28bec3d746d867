"""The local sandbox: model-written code as a process tree on this machine, contained.

Each sandbox owns a fresh host directory (`<root>/work`, `<root>/tmp`). Each `exec`
starts one process tree in it under the strongest isolation the machine gives:

- `bwrap`: bubblewrap with new user, pid, net, ipc, uts and mount namespaces and a
  filesystem made only of read-only /usr (and the /bin, /lib* links), a few /etc files,
  /proc, /dev, and the sandbox's own `/work` and `/tmp`. No home directories, no /root,
  no project files, no network.
- `namespaces`: `unshare` (user, pid, net, ipc, uts, mount) with tmpfs laid over /root,
  /home and the project; the rest of the host filesystem stays readable.
- `rlimits`: a plain process with resource limits only (trusted code).

On top of any of them: rlimits (CPU, file size, processes, address space), a cgroup
(memory + pids) where one can be made, a private uid when started as root, and a
wall-clock timeout after which the whole tree is killed. When the command's main
process ends, everything it left behind is killed too: nothing outlives an `exec`.
`start()` logs which isolation it got and refuses to go below `min_isolation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.envs.sandbox.base import ExecResult, OutputCapture, Sandbox, SandboxError, isolation_at_least
from agentrl.envs.sandbox.limits import Cgroup, Limits, kill_uid, launcher, pids_of_uid, threads_of_uid
from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.config import LocalSandboxConfig

logger = get_logger("envs.sandbox")

PROJECT_ROOT = Path(__file__).resolve().parents[3]
ETC_FILES = [
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types", "/etc/ssl/openssl.cnf",
]  # fmt: skip
HIDDEN_FOR_NAMESPACES = ["/root", "/home", str(PROJECT_ROOT)]
_probe_cache: dict[tuple[str, bool], bool] = {}
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


def _probe(level: str, argv: list[str], uid: int | None) -> bool:
    """Whether a trivial command runs under `level` on this machine (cached per process)."""
    key = (level, uid is not None)  # every private uid behaves alike: probe once
    if key not in _probe_cache:
        try:
            done = subprocess.run([*launcher(None, None, uid, None), *argv], capture_output=True, timeout=20)
            _probe_cache[key] = done.returncode == 0
            if done.returncode:
                logger.debug("%s unavailable: %s", level, done.stderr.decode(errors="replace").strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.debug("%s unavailable: %s", level, exc)
            _probe_cache[key] = False
    return _probe_cache[key]


def available_isolation(uid: int | None) -> list[str]:
    """Isolation levels this machine offers now, strongest first. Every level but `none` needs
    util-linux `prlimit` (and `setpriv` when started as root) to apply the limits."""
    if not shutil.which("prlimit") or (uid is not None and not shutil.which("setpriv")):
        logger.warning("util-linux prlimit/setpriv not found: no sandbox limits can be applied")
        return ["none"]
    levels = []
    with tempfile.TemporaryDirectory(prefix="agentrl-probe-") as scratch:
        os.chmod(scratch, 0o755)  # reachable by the sandbox uid
        if shutil.which("bwrap") and _probe(
            "bwrap", [*_bwrap_prefix(scratch, scratch, "/work", []), "true"], uid
        ):
            levels.append("bwrap")
        unshare = [*_unshare_prefix([], scratch), "true"]
        if shutil.which("unshare") and shutil.which("setpriv") and _probe("namespaces", unshare, uid):
            levels.append("namespaces")
    return [*levels, "rlimits", "none"]


SITE_INSIDE = "/opt/agentrl-site"


def _bwrap_prefix(
    work: str, tmp: str, workdir: str, ro_paths: list[str], site: str | None = None
) -> list[str]:
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for path in ETC_FILES + ro_paths:
        args += ["--ro-bind-try", path, path]
    if site:
        args += ["--ro-bind", site, SITE_INSIDE]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", tmp, "/tmp", "--bind", work, workdir]
    return [*args, "--remount-ro", "/", "--chdir", workdir, "--"]


def _unshare_prefix(hide: list[str], cwd: str) -> list[str]:
    mounts = "".join(f"mount -t tmpfs -o size=1m,mode=0755 none {shlex.quote(p)} 2>/dev/null; " for p in hide)
    # drop every capability (bounding set too) so the mapped root cannot lift the tmpfs covers
    script = f'{mounts}cd {shlex.quote(cwd)} && exec setpriv --bounding-set=-all --inh-caps=-all -- "$@"'
    unshare = ["unshare", "--user", "--map-root-user", "--pid", "--net", "--mount", "--ipc", "--uts"]
    return [*unshare, "--fork", "--kill-child", "--mount-proc", "/bin/sh", "-c", script, "sh"]


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
        self.uid: int | None = None
        self.isolation = "none"
        self.details: dict[str, object] = {}
        self.site: Path | None = None

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
        self.isolation = level
        if cfg.python_packages:
            from agentrl.envs.sandbox.pypkgs import site_dir

            try:
                self.site = await asyncio.to_thread(site_dir, cfg.python_packages)
            except ValueError as exc:
                raise SandboxError(str(exc)) from None
        if cfg.root_dir:
            Path(cfg.root_dir).mkdir(parents=True, exist_ok=True)
            if self.uid is not None:
                _check_traversable(Path(cfg.root_dir), self.uid)
        self.root = Path(tempfile.mkdtemp(prefix="agentrl-sandbox-", dir=cfg.root_dir))
        work, tmp = self.root / "work", self.root / "tmp"
        if image_or_spec:
            source = Path(image_or_spec)
            if not source.is_dir():
                raise SandboxError(f"local sandbox: {image_or_spec!r} is not a directory to copy in")
            await asyncio.to_thread(shutil.copytree, source, work, symlinks=True)
        else:
            work.mkdir()
        tmp.mkdir()
        if self.uid is not None:
            await asyncio.to_thread(self._chown_tree, self.root)
        self.workdir = cfg.workdir if level == "bwrap" else str(work)
        self.tmpdir = "/tmp" if level == "bwrap" else str(tmp)
        if level != "none":
            self.cgroup = Cgroup.create(self.limits)
        self.details = {
            "isolation": level,
            "uid": self.uid if self.uid is not None else os.getuid(),
            "cgroup": f"v{self.cgroup.version}" if self.cgroup else None,
            "network": level == "rlimits" or level == "none",
            "memory_limit": "cgroup" if self.cgroup else ("rlimit_as" if level != "none" else None),
        }
        logger.info("local sandbox %s: %s", self.root.name, self.details)

    async def close(self) -> None:
        await asyncio.to_thread(self._kill_all)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            self.root = None
        if self.uid is not None:  # forget it: another sandbox may be given this uid next
            with _uid_lock:
                _uids_in_use.discard(self.uid)
            self.uid = None

    def _chown_tree(self, top: Path) -> None:
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

    def _argv(self, cmd: str | list[str]) -> list[str]:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        work, tmp = str(self.root / "work"), str(self.root / "tmp")
        if self.isolation == "bwrap":
            site = str(self.site) if self.site else None
            return _bwrap_prefix(work, tmp, self.config.workdir, self.config.ro_paths, site) + argv
        if self.isolation == "namespaces":
            hide = [p for p in HIDDEN_FOR_NAMESPACES if os.path.isdir(p) and not work.startswith(p + "/")]
            return _unshare_prefix(hide, work) + argv
        return argv

    def _nproc(self) -> int | None:
        if self.isolation == "none":
            return None
        if self.uid is not None:
            return self.config.max_processes
        # our uid is shared with the host's own processes: allow what already runs, plus the budget
        return threads_of_uid(os.getuid()) + self.config.max_processes

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
            site = SITE_INSIDE if self.isolation == "bwrap" else str(self.site)
            full_env["PYTHONPATH"] = ":".join(p for p in (full_env.get("PYTHONPATH"), site) if p)
        limits = self.limits if self.isolation != "none" else None
        oom_before = self.cgroup.oom_kills() if self.cgroup else 0
        limiter = launcher(limits, self.cgroup, self.uid, self._nproc())
        proc = await asyncio.create_subprocess_exec(
            *limiter,
            *self._argv(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=str(self.root / "work"),
            env=full_env,
            start_new_session=True,
        )
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
        if timed_out:
            stderr += f"\n[sandbox: timed out after {timeout:g}s; process tree killed]"
        return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, timed_out=timed_out)

    # ------------------------------------------------------------------ files

    def _host_path(self, path: str) -> Path:
        """The host path behind a sandbox path, refusing anything outside work/ and tmp/
        (symlinks the sandboxed code planted included: nothing runs while we resolve)."""
        if self.root is None:
            raise SandboxError("sandbox not started")
        inside_tmp = self.tmpdir
        p = Path(path)
        if not p.is_absolute():
            p = Path(self.workdir) / p
        base, host_base = Path(self.workdir), self.root / "work"
        if p == Path(inside_tmp) or Path(inside_tmp) in p.parents:
            base, host_base = Path(inside_tmp), self.root / "tmp"
        elif not (p == base or base in p.parents):
            raise PermissionError(f"{path}: outside the sandbox's writable directories")
        host = host_base / os.path.relpath(os.path.normpath(p), base)
        resolved = host.resolve()
        if not (resolved == host_base.resolve() or host_base.resolve() in resolved.parents):
            raise PermissionError(f"{path}: resolves outside the sandbox")
        return resolved

    async def write_file(self, path: str, data: str | bytes) -> None:
        host = self._host_path(path)
        payload = data.encode() if isinstance(data, str) else data

        def write() -> None:
            missing = [d for d in [host.parent, *host.parent.parents] if not d.exists()]
            host.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            if self.uid is not None:  # the sandboxed code must be able to edit what we wrote
                for made in [host, *missing]:
                    os.lchown(made, self.uid, self.uid)

        await asyncio.to_thread(write)

    async def read_file(self, path: str) -> bytes:
        host = self._host_path(path)

        def read() -> bytes:
            fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                return f.read()

        return await asyncio.to_thread(read)


async def _pump(stream: asyncio.StreamReader | None, capture: OutputCapture) -> None:
    """Read a pipe to its end, keeping only what the capture holds (the child never blocks)."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        capture.feed(chunk)
