"""The host-side file API beneath a directory descriptor: links are never followed, whichever
way the kernel resolves (openat2 or the component walk), even while another thread swaps a
directory for a link to the outside as fast as it can."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.envs.sandbox import hostfs

CANARY = b"host canary: must never be read through the sandbox\n"


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


def test_a_flipping_directory_never_leads_outside(resolver: str, tree: tuple[int, Path, Path]) -> None:
    """`d` is swapped between a real directory and a link to the host dir while we read and
    write `d/canary` hundreds of times: every call either works inside or is refused."""
    fd, inside, outside = tree
    real, link = inside / "d.real", inside / "d.link"
    real.mkdir()
    (real / "canary").write_bytes(b"inside\n")
    link.symlink_to(outside)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for source in (real, link):
                try:
                    os.rename(source, inside / "d")  # atomically replaces d (dir <-> link)
                    os.rename(inside / "d", source)
                except OSError:
                    pass

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    outcomes = {"ok": 0, "refused": 0}
    try:
        for i in range(400):
            try:
                data = hostfs.read_beneath(fd, "d/canary", 1000)
                assert data != CANARY, "read a host file through the link"
                outcomes["ok"] += 1
            except (PermissionError, FileNotFoundError, NotADirectoryError):
                outcomes["refused"] += 1
            try:
                hostfs.write_beneath(fd, f"d/written-{i}", b"x")
                outcomes["ok"] += 1
            except (PermissionError, FileNotFoundError, NotADirectoryError, FileExistsError):
                outcomes["refused"] += 1
    finally:
        stop.set()
        flipper.join()
    assert (outside / "canary").read_bytes() == CANARY
    assert sorted(p.name for p in outside.iterdir()) == ["canary"], "a file was created outside"
    assert sum(outcomes.values()) == 800
