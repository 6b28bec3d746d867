"""The host-side file API beneath a directory descriptor: links are never followed, whichever
way the kernel resolves (openat2 or the component walk), even while another thread swaps a
directory for a link to the outside as fast as it can."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.envs.sandbox import hostfs

CANARY = b"host canary: must never be read through the sandbox\n"
AT_FDCWD, RENAME_EXCHANGE = -100, 2


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "openat2" and not hostfs.has_openat2():
        pytest.skip("this kernel has no openat2 (Linux < 5.6)")
    monkeypatch.setattr(hostfs, "_have_openat2", request.param == "openat2")
    return request.param


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """(descriptor of a sandbox dir, that dir, a host dir outside it holding the canary)."""
    inside, outside = tmp_path / "box", tmp_path / "host"
    inside.mkdir()
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY)
    fd = os.open(inside, os.O_RDONLY | os.O_DIRECTORY)
    yield fd, inside, outside
    os.close(fd)


def test_round_trip_and_refusals(resolver: str, tree: tuple[int, Path, Path]) -> None:
    fd, inside, outside = tree
    hostfs.write_beneath(fd, "a/b/c.txt", b"hello")
    assert (inside / "a" / "b" / "c.txt").read_bytes() == b"hello"
    assert hostfs.read_beneath(fd, "a/b/c.txt", 100) == b"hello"
    hostfs.write_beneath(fd, "a/b/c.txt", b"hi")  # truncated, not appended
    assert hostfs.read_beneath(fd, "./a/../a/b/c.txt", 100) == b"hi"
    with pytest.raises(FileNotFoundError):
        hostfs.read_beneath(fd, "a/missing", 100)
    with pytest.raises(IsADirectoryError):
        hostfs.read_beneath(fd, "a", 100)
    with pytest.raises(PermissionError, match="read limit"):
        hostfs.read_beneath(fd, "a/b/c.txt", 1)
    assert hostfs.split("../../etc/passwd") == ["etc", "passwd"]  # lexically clamped to the root
    (inside / "file-link").symlink_to(outside / "canary")
    (inside / "dir-link").symlink_to(outside)
    (inside / "inner-link").symlink_to("a")  # even a link that stays inside is refused
    for path in ("file-link", "dir-link/canary", "inner-link/b/c.txt"):
        with pytest.raises(PermissionError, match="symbolic link"):
            hostfs.read_beneath(fd, path, 1000)
        with pytest.raises(PermissionError, match="symbolic link"):
            hostfs.write_beneath(fd, path, b"x")
    with pytest.raises(PermissionError, match="symbolic link"):
        hostfs.write_beneath(fd, "dir-link/new/file", b"x")
    os.mkfifo(inside / "fifo")  # would block a plain open() for ever
    with pytest.raises(PermissionError, match="not a regular file"):
        hostfs.read_beneath(fd, "fifo", 100)
    assert (outside / "canary").read_bytes() == CANARY
    assert sorted(p.name for p in outside.iterdir()) == ["canary"]


def test_owner_of_what_is_created(resolver: str, tree: tuple[int, Path, Path]) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving files to another uid needs root")
    fd, inside, _ = tree
    hostfs.write_beneath(fd, "made/here.txt", b"x", owner=4321)
    assert (inside / "made").stat().st_uid == 4321
    assert (inside / "made" / "here.txt").stat().st_uid == 4321


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (`renameat2(RENAME_EXCHANGE)`): each name always exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), RENAME_EXCHANGE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def test_a_flipping_directory_never_leads_outside(resolver: str, tree: tuple[int, Path, Path]) -> None:
    """`d` is swapped atomically between a real directory and a link to the host dir while we
    read and write `d/canary` hundreds of times: every call either works inside or is refused.
    (`d` always exists: a plain rename would leave gaps in which a write creates `d` afresh and
    the race stops.)"""
    fd, inside, outside = tree
    real, link = inside / "d", inside / "d.other"
    real.mkdir()
    (real / "canary").write_bytes(b"inside\n")
    link.symlink_to(outside)
    try:
        _exchange(real, link)
        _exchange(real, link)
    except (OSError, AttributeError) as exc:
        pytest.skip(f"this kernel, C library or file system cannot exchange paths atomically: {exc}")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            _exchange(real, link)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    outcomes = {"read": 0, "written": 0, "refused": 0}
    written: set[str] = set()
    i = 0
    try:
        # 400 rounds, more (up to 5000) until each way through has been taken a few times: most
        # calls meet the link, and the share that meets the real directory varies from run to run
        while i < 400 or (min(outcomes["read"], len(written)) < 5 and i < 5000):
            i += 1
            try:
                data = hostfs.read_beneath(fd, "d/canary", 1000)
                assert data == b"inside\n", f"read {data!r}, not the sandbox's own file"
                outcomes["read"] += 1
            except (PermissionError, FileNotFoundError, NotADirectoryError):
                outcomes["refused"] += 1
            try:
                hostfs.write_beneath(fd, f"d/written-{i}", b"x")
                written.add(f"written-{i}")
            except (PermissionError, FileNotFoundError, NotADirectoryError, FileExistsError):
                outcomes["refused"] += 1
    finally:
        stop.set()
        flipper.join()
    outcomes["written"] = len(written)
    assert (outside / "canary").read_bytes() == CANARY
    assert sorted(p.name for p in outside.iterdir()) == ["canary"], "a file was created outside"
    # every write reported done is a file inside the sandbox (links not followed), none refused is
    landed = {name for _, _, files in os.walk(inside) for name in files if name.startswith("written-")}
    assert landed == written, (sorted(landed ^ written)[:5], outcomes)
    # the race ran both ways: calls went through the real directory and were refused at the link
    assert outcomes["read"] and outcomes["written"] and outcomes["refused"], outcomes
