"""Host-side file access beneath a sandbox directory that sandboxed code cannot race.

The local backend's `read_file` / `write_file` run on the host while the model's code may
be running too, free to swap any directory of its work tree for a symbolic link at any
moment. Resolving a path first and opening it afterwards (or `O_NOFOLLOW`, which guards
only the last component) loses that race. Here every component is resolved relative to
a directory file descriptor held for the sandbox's life, and no link is ever followed:

- `openat2(2)` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
  RESOLVE_NO_XDEV` where the kernel has it (Linux >= 5.6), one syscall through libc's
  `syscall()`, since Python's `os` does not wrap it;
- elsewhere a walk, one component at a time, each opened `O_NOFOLLOW | O_DIRECTORY`
  relative to the previous one's descriptor.

A path through a symbolic link is refused (PermissionError), links that stay inside too:
the host cannot tell a planted link from an innocent one at the moment it opens it. Only
regular files are read or written (a FIFO would block the host; a device is never ours).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat

O_BASE = os.O_CLOEXEC | os.O_NOCTTY
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
SYS_OPENAT2 = 437  # the same number on every architecture (asm-generic unified table, Linux 5.6)


class _OpenHow(ctypes.Structure):
    """`struct open_how` of linux/openat2.h."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_have_openat2: bool | None = None


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, RESOLVE)
    fd = _syscall(
        ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def has_openat2() -> bool:
    """Whether this kernel (and any seccomp policy around us) lets openat2 through."""
    global _have_openat2
    if _have_openat2 is None:
        try:
            os.close(_openat2(os.open("/", os.O_RDONLY | os.O_DIRECTORY | O_BASE), ".", os.O_PATH | O_BASE))
            _have_openat2 = True
        except OSError as exc:  # ENOSYS: kernel < 5.6; EPERM: a container's seccomp policy
            _have_openat2 = exc.errno not in (errno.ENOSYS, errno.EPERM)
    return _have_openat2


def split(relative: str) -> list[str]:
    """The components of a path relative to the sandbox directory; `..` that would climb out of
    it is refused (normalised lexically: nothing is resolved on the host)."""
    parts = [p for p in posixpath.normpath("/" + relative).split("/") if p]
    if ".." in parts:  # normpath of an absolute path keeps none; belt and braces
        raise PermissionError(f"{relative}: climbs out of the sandbox")
    return parts


def _refusal(dir_fd: int, name: str, exc: OSError) -> OSError:
    """A clear error for a component that could not be opened without following a link."""
    if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link or exc.errno != errno.ENOTDIR:
            return PermissionError(errno.EPERM, "a symbolic link or mount point: not followed", name)
    return exc


def _open_one(dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
    try:
        if has_openat2():
            return _openat2(dir_fd, name, flags | O_BASE, mode)
        return os.open(name, flags | O_BASE | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(dir_fd, name, exc) from None


def open_dir(root_fd: int, parts: list[str], create: bool = False, owner: int | None = None) -> int:
    """A descriptor of the directory `parts` beneath `root_fd`, created (and given to `owner`)
    where missing when `create`. The caller closes it."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            try:
                child = _open_one(fd, name, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                if not create:
                    raise
                child = -1
            if child < 0:
                os.mkdir(name, 0o755, dir_fd=fd)  # mkdirat never follows a link in the last component
                child = _open_one(fd, name, os.O_RDONLY | os.O_DIRECTORY)  # refuses a swap since mkdir
                if owner is not None:
                    os.fchown(child, owner, owner)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _regular(fd: int, name: str) -> os.stat_result:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", name)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(errno.EPERM, "not a regular file", name)
    return st


def read_beneath(root_fd: int, relative: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `relative` beneath `root_fd`, at most `max_bytes` of them
    (a larger file is an error, not a truncated read)."""
    parts = split(relative)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
    if has_openat2():
        fd = _open_one(root_fd, "/".join(parts), os.O_RDONLY | os.O_NONBLOCK)
    else:
        parent = open_dir(root_fd, parts[:-1])
        try:
            fd = _open_one(parent, parts[-1], os.O_RDONLY | os.O_NONBLOCK)
        finally:
            os.close(parent)
    with os.fdopen(fd, "rb") as f:
        if _regular(fd, relative).st_size > max_bytes:
            raise PermissionError(errno.EFBIG, f"larger than the {max_bytes}-byte read limit", relative)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise PermissionError(errno.EFBIG, f"larger than the {max_bytes}-byte read limit", relative)
    return data


def write_beneath(root_fd: int, relative: str, payload: bytes, owner: int | None = None) -> None:
    """Write the regular file `relative` beneath `root_fd`, creating its parent directories
    (each created one, and the file, given to `owner`)."""
    parts = split(relative)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
    parent = open_dir(root_fd, parts[:-1], create=True, owner=owner)
    try:
        # no O_TRUNC: truncate only once the descriptor is known to be a regular file of ours
        fd = _open_one(parent, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        _regular(fd, relative)
        os.ftruncate(fd, 0)
        f.write(payload)
        if owner is not None:
            os.fchown(fd, owner, owner)
