"""Resource limits for local sandboxes: rlimits, a per-sandbox cgroup, and killing a tree.

Three layers, each used where the machine allows it:

- rlimits, set by util-linux `prlimit` in front of the command: CPU seconds, file
  size, core dumps, process count, and address space when no memory cgroup exists;
- a cgroup per sandbox (v2, or v1 `memory` + `pids`) when this process may create one
  (root, or a delegated subtree): memory and pids for the whole tree, and a reliable
  list of every process to kill;
- when started as root the sandbox runs as its own unprivileged uid, so RLIMIT_NPROC
  counts only its processes and every leftover can be found by uid and killed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from agentrl.log import get_logger

logger = get_logger("envs.sandbox")

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class Limits:
    memory_mb: int
    max_processes: int
    cpu_time_s: int
    max_file_size_mb: int


def _own_cgroup_paths() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


class Cgroup:
    """A cgroup (v2) or a pair of cgroups (v1 memory + pids) holding one sandbox's processes."""

    def __init__(self, dirs: list[Path], version: int) -> None:
        self.dirs = dirs
        self.version = version

    @property
    def controllers(self) -> list[str]:
        return ["memory", "pids"]

    @classmethod
    def create(cls, limits: Limits) -> Cgroup | None:
        """A fresh cgroup with the memory and pids limits, or None where none can be made."""
        try:
            own = _own_cgroup_paths()
        except OSError:
            return None
        name = f"agentrl-sandbox-{uuid.uuid4().hex[:12]}"
        memory = str(limits.memory_mb << 20)
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            return cls._create_v2(CGROUP_ROOT / own.get("", "/").lstrip("/") / name, memory, limits)
        made: list[Path] = []
        try:
            for controller in ("memory", "pids"):
                base = CGROUP_ROOT / controller
                path = base / own.get(controller, "/").lstrip("/") / name
                path.mkdir()
                made.append(path)
            mem, pids = made
            (mem / "memory.limit_in_bytes").write_text(memory)
            if (mem / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                (mem / "memory.memsw.limit_in_bytes").write_text(memory)
            (pids / "pids.max").write_text(str(limits.max_processes))
        except OSError as exc:
            logger.debug("no v1 cgroup for the sandbox: %s", exc)
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            return None
        return cls(made, version=1)

    @classmethod
    def _create_v2(cls, path: Path, memory: str, limits: Limits) -> Cgroup | None:
        try:
            enabled = (path.parent / "cgroup.subtree_control").read_text().split()
            missing = [c for c in ("memory", "pids") if c not in enabled]
            if missing:
                (path.parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
            path.mkdir()
        except OSError as exc:
            logger.debug("no v2 cgroup for the sandbox: %s", exc)
            return None
        try:
            (path / "memory.max").write_text(memory)
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
            (path / "pids.max").write_text(str(limits.max_processes))
        except OSError as exc:
            logger.debug("v2 cgroup limits refused: %s", exc)
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls([path], version=2)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory limit so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, until it is empty (forks racing the kill included)."""
        if self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
        for _ in range(500):  # a fork bomb under load can take seconds to die out
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        logger.warning("processes still in sandbox cgroup after kill: %s", sorted(self.pids()))

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def pids_of_uid(uid: int) -> list[int]:
    """Every live (not zombie) process whose real uid is `uid`, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith(("Z", "X")):
            pids.append(int(entry))
    return pids


def kill_uid(uid: int) -> None:
    """SIGKILL every process of a sandbox's private uid (only ever called with such a uid)."""
    for _ in range(500):  # a fork bomb under load can take seconds to die out
        pids = pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def threads_of_uid(uid: int) -> int:
    """Tasks (threads) the uid runs now: what RLIMIT_NPROC counts."""
    total = 0
    for pid in pids_of_uid(uid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    total += int(line.split()[1])
    return total


def launcher(limits: Limits | None, cgroup: Cgroup | None, uid: int | None, nproc: int | None) -> list[str]:
    """The argv prefix that puts a command in the cgroup, under the rlimits, as `uid`.

    A chain of small exec()s — `sh` joins the cgroup (as the caller, before anything can
    fork), util-linux `prlimit` sets the limits, `setpriv` drops to the uid — rather than a
    Python `preexec_fn`, which can deadlock in the forked child of a process with threads
    (and a roller has many)."""
    argv: list[str] = []
    if cgroup is not None:
        joins = " && ".join(f"echo $$ > {shlex.quote(path)}" for path in cgroup.procs_files())
        argv += ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh"]
    if limits is not None:
        cpu, size = limits.cpu_time_s, limits.max_file_size_mb << 20
        argv += ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--fsize={size}", "--core=0"]
        if nproc is not None:
            argv.append(f"--nproc={nproc}")
        if cgroup is None:
            argv.append(f"--as={limits.memory_mb << 20}")
        argv.append("--")
    if uid is not None:
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return argv
