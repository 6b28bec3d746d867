"""Build a minimal root filesystem tarball from this host's own binaries, for `docker import`.

For machines with a Docker engine but no registry: no base image to pull, so we make one
from what the host already has — a shell, coreutils and (optionally) the system Python
with its standard library — plus every shared library they link (found with ldd).

    python sandboxes/host_rootfs.py /tmp/rootfs.tar --python
    docker import /tmp/rootfs.tar agentrl/host-python:latest

The result runs `sh`, the usual file/text tools and `python3`; it is what the Docker
sandbox tests use, and a base you can `FROM` in sandboxes/Dockerfile.* without a registry.
Only system paths go in: never home directories, credentials or the project.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

TOOLS = [
    "sh", "bash", "env", "cat", "echo", "ls", "mkdir", "rm", "cp", "mv", "ln", "head", "tail", "wc", "sleep",
    "true", "false", "test", "grep", "sed", "sort", "uniq", "tr", "cut", "find", "xargs", "kill", "id",
    "stat", "touch", "chmod", "dirname", "basename", "printf", "timeout", "diff", "patch", "nproc", "yes", "git",
    "ps", "awk", "tee", "which",
]  # fmt: skip
SKIP_STDLIB = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "__pycache__",
}
ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1 localhost\n",
}


def shared_libs(binary: str) -> set[str]:
    """Absolute paths of the shared libraries `binary` loads (the dynamic loader included)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return set(re.findall(r"(/\S+\.so[^\s]*)", out))


def add_file(tar: tarfile.TarFile, path: str, seen: set[str]) -> None:
    """Add `path` (following symlinks to keep both the link and its target) under the same name."""
    if path in seen or not os.path.lexists(path):
        return
    seen.add(path)
    for parent in reversed(Path(path).parents[:-1]):
        add_dir(tar, str(parent), seen)
    info = tar.gettarinfo(path, arcname=path.lstrip("/"))
    if info.issym():  # keep every hop (e.g. /usr/bin/awk -> /etc/alternatives/awk -> mawk)
        tar.addfile(info)
        add_file(tar, os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path))), seen)
    elif info.isreg():
        with open(path, "rb") as f:
            tar.addfile(info, f)


def add_dir(tar: tarfile.TarFile, path: str, seen: set[str]) -> None:
    if path in seen or path == "/":
        return
    seen.add(path)
    if os.path.islink(path):  # merged-/usr hosts: /lib -> usr/lib
        tar.addfile(tar.gettarinfo(path, arcname=path.lstrip("/")))
        add_dir(tar, os.path.realpath(path), seen)
        return
    info = tarfile.TarInfo(path.lstrip("/"))
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    tar.addfile(info)


def build(out: Path, with_python: bool) -> int:
    seen: set[str] = set()
    binaries = [p for p in (shutil.which(t, path="/usr/bin:/bin") for t in TOOLS) if p]
    if with_python:
        binaries.append(os.path.realpath("/usr/bin/python3"))
    with tarfile.open(out, "w") as tar:
        for name in ("bin", "sbin", "lib", "lib64"):
            if os.path.islink(f"/{name}"):
                add_dir(tar, f"/{name}", seen)
        for binary in binaries:
            add_file(tar, binary, seen)
            for lib in shared_libs(binary):
                add_file(tar, lib, seen)
        if with_python:
            add_python(tar, seen)
        for name, text in ETC.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o644
            add_dir(tar, "/etc", seen)
            tar.addfile(info, io.BytesIO(text.encode()))
        for name in ("tmp", "work", "root"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
            tar.addfile(info)
    return len(seen)


def add_python(tar: tarfile.TarFile, seen: set[str]) -> None:
    """The system Python's standard library (no site-packages) and its extension modules' libs."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    out = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
    )
    version = out.stdout.strip() or version
    stdlib = Path("/usr/lib") / version
    add_file(tar, "/usr/bin/python3", seen)
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [
            d for d in dirnames if d not in SKIP_STDLIB and d not in ("site-packages", "dist-packages")
        ]
        for name in filenames:
            path = os.path.join(dirpath, name)
            add_file(tar, path, seen)
            if name.endswith(".so"):
                for lib in shared_libs(path):
                    add_file(tar, lib, seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="tarball to write")
    parser.add_argument("--python", action="store_true", help="include the system python3 and its stdlib")
    args = parser.parse_args(argv)
    count = build(args.out, args.python)
    print(f"wrote {args.out} ({count} paths, {args.out.stat().st_size >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
