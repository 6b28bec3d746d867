"""The argv prefixes that put one command inside a local sandbox, and which of them work here.

Both namespace levels build the same view for the command: a read-only root holding
/usr (and the /bin, /lib* links), a few /etc files, the optional read-only paths, a fresh
/proc and a minimal /dev, and the sandbox's own `work/` at `workdir` and `tmp/` at /tmp.
No home directories, no project files, no network, no host path in sight (not even in
/proc/1/cmdline), so the prompts the model sees are the same at both levels.

- `bwrap`: bubblewrap. Its options come through a memfd (`--args FD`), so its command line
  (what /proc/1/cmdline shows inside) holds no host path; the seccomp filter of
  `seccomp.py` comes through another (`--seccomp FD`). /dev/shm is a tmpfs of DEV_SHM_MB
  where bubblewrap has `--size` (0.8+), as the whole /dev is at the `namespaces` level.
- `namespaces`: util-linux `unshare` (user, pid, net, ipc, uts, mount) and a shell script
  that mounts the same view on a tmpfs and `chroot`s into it, every capability dropped
  (bounding set included) and no_new_privs set. The script runs with the sandbox's root
  directory as its working directory and names only paths relative to it. PID 1 is a
  shell waiting for the command, so the command gets the signal semantics of any other
  process (PID 1 ignores signals it has no handler for) and a signal exit is 128 + N.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from agentrl.envs.sandbox.limits import launcher
from agentrl.log import get_logger

logger = get_logger("envs.sandbox")

ETC_FILES = [
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types", "/etc/ssl/openssl.cnf",
]  # fmt: skip
TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SITE_INSIDE = "/opt/agentrl-site"
NEWROOT = "newroot"
"""Empty directory in a sandbox's root that the `namespaces` level mounts its root on."""
DEV_SHM_MB = 64
"""Size of the sandbox's /dev (with /dev/shm in it): tmpfs, memory the disk quota does not cover."""
_probe_cache: dict[tuple[str, bool], bool] = {}


@functools.cache
def _bwrap_has_size() -> bool:
    """Whether this bubblewrap takes `--size` for a tmpfs (0.8.0 and later)."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in done.stdout


def bwrap_options(
    work: str,
    tmp: str,
    workdir: str,
    ro_paths: list[str],
    site: str | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """bubblewrap's options (everything between `bwrap` and `--`)."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in TOP_LINKS:
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for path in ETC_FILES + ro_paths:
        args += ["--ro-bind-try", path, path]
    if site:
        args += ["--ro-bind", site, SITE_INSIDE]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", tmp, "/tmp", "--bind", work, workdir]
    if _bwrap_has_size():  # /dev/shm is memory outside the disk quota: bound it as the fallback does
        args += ["--size", str(DEV_SHM_MB << 20), "--tmpfs", "/dev/shm"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return [*args, "--remount-ro", "/", "--chdir", workdir]


def bwrap_prefix(*args, **kwargs) -> list[str]:
    """`bwrap OPTIONS --` with the options on the command line (probing, no fds to pass)."""
    return ["bwrap", *bwrap_options(*args, **kwargs), "--"]


def _chroot() -> str:
    return shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin") or "chroot"


def namespaces_prefix(workdir: str, ro_paths: list[str], site: str | None = None) -> list[str]:
    """`unshare ... sh -c SCRIPT sh` building the sandbox's view (run with the sandbox root as cwd)."""
    q = shlex.quote
    lines = [
        "set -e",
        f"R={NEWROOT}",
        "mount -t tmpfs -o size=1m,mode=0755,nosuid,nodev agentrl-root $R",
        # bind $1 at $2 inside (a file or a directory), read-only when $3 = ro; missing sources skip.
        # Recursive, as bwrap binds: a plain bind of a tree with locked submounts is refused in a userns
        'bind() { [ -e "$1" ] || return 0; if [ -d "$1" ]; then mkdir -p "$R$2"; '
        'else mkdir -p "$(dirname "$R$2")"; : > "$R$2"; fi; mount --rbind "$1" "$R$2"; '
        '[ "$3" = ro ] || return 0; mount -o remount,bind,ro "$R$2" 2>/dev/null '
        '|| mount -o remount,bind,ro,nosuid,nodev "$R$2"; }',
        "bind /usr /usr ro",
    ]
    for name in TOP_LINKS:
        if os.path.islink(name):
            lines.append(f"ln -s {q(os.readlink(name))} $R{name}")
        elif os.path.isdir(name):
            lines.append(f"bind {name} {name} ro")
    lines += [f"bind {q(p)} {q(p)} ro" for p in ETC_FILES + ro_paths]
    if site:
        lines.append(f"bind {q(site)} {SITE_INSIDE} ro")
    lines += [
        "mkdir $R/proc $R/dev $R/tmp",
        "mount -t proc -o nosuid,nodev,noexec proc $R/proc",
        f"mount -t tmpfs -o size={DEV_SHM_MB}m,mode=0755,nosuid agentrl-dev $R/dev",
        *(f"bind /dev/{d} /dev/{d}" for d in DEVICES),
        "ln -s /proc/self/fd $R/dev/fd; ln -s /proc/self/fd/0 $R/dev/stdin",
        "ln -s /proc/self/fd/1 $R/dev/stdout; ln -s /proc/self/fd/2 $R/dev/stderr; mkdir $R/dev/shm",
        "mount --bind tmp $R/tmp",
        f"mkdir -p $R{q(workdir)}; mount --bind work $R{q(workdir)}",
        "mount -o remount,bind,ro,nosuid,nodev $R",
        "cd $R",
        # PID 1 becomes a shell inside the new root that runs the command as its child; the shell's
        # own stderr ("Terminated" after a signal exit) goes to /dev/null, the command's does not
        f"exec {_chroot()} . setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- "
        f'/bin/sh -c \'cd "$0" 2>&3 || exit 126; (exec 2>&3 3>&- && exec "$@"); exit $?\' {q(workdir)} "$@" 3>&2 2>/dev/null',
    ]
    unshare = ["unshare", "--user", "--map-root-user", "--pid", "--net", "--mount", "--ipc", "--uts"]
    return [*unshare, "--fork", "--kill-child", "/bin/sh", "-c", "\n".join(lines), "sh"]


def _probe(level: str, argv: list[str], uid: int | None, cwd: str) -> bool:
    """Whether a trivial command runs under `level` on this machine (cached per process)."""
    key = (level, uid is not None)  # every private uid behaves alike: probe once
    if key not in _probe_cache:
        try:
            argv = [*launcher(None, None, uid, None), *argv]
            done = subprocess.run(argv, capture_output=True, timeout=20, cwd=cwd)
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
        for name in ("work", "tmp", NEWROOT):
            Path(scratch, name).mkdir()
            if uid is not None:
                os.chown(Path(scratch, name), uid, uid)
        work, tmp = f"{scratch}/work", f"{scratch}/tmp"
        bwrap = [*bwrap_prefix(work, tmp, "/work", []), "true"]
        if shutil.which("bwrap") and _probe("bwrap", bwrap, uid, work):
            levels.append("bwrap")
        tools = all(shutil.which(t) for t in ("unshare", "setpriv")) and _chroot() != "chroot"
        if tools and _probe("namespaces", [*namespaces_prefix("/work", []), "true"], uid, scratch):
            levels.append("namespaces")
    return [*levels, "rlimits", "none"]
