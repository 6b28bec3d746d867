"""The seccomp program, loaded for real into a child process (no bubblewrap needed): namespace
and mount calls fail with EPERM, clone3 with ENOSYS, and ordinary work — forking, threads,
subprocesses, files — is untouched."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from agentrl.envs.sandbox import seccomp

CHILD = textwrap.dedent(
    """
    import ctypes, errno, os, subprocess, sys, threading
    from agentrl.envs.sandbox.seccomp import ARCHES, program
    prog = program()
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(prog, len(prog))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, ctypes.addressof(buf))), 0, 0) == 0
    nr = ARCHES[os.uname().machine][1]
    def errno_of(*call):
        ctypes.set_errno(0)
        libc.syscall(*call)
        return errno.errorcode.get(ctypes.get_errno(), "ok")
    print("unshare", errno_of(nr["unshare"], 0x10000000))
    print("setns", errno_of(nr["setns"], 0, 0))
    print("mount", errno_of(nr["mount"], b"none", b"/tmp", b"tmpfs", 0, 0))
    print("clone-newuser", errno_of(nr["clone"], 0x10000000 | 17, 0, 0, 0, 0))
    print("clone3", errno_of(nr["clone3"], 0, 0))
    nested = subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True, text=True)
    print("nested-unshare", nested.returncode)
    worker = threading.Thread(target=lambda: None); worker.start(); worker.join()
    print("work", subprocess.run(["sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True).stdout.strip())
    """
)


@pytest.mark.skipif(platform.machine() not in seccomp.ARCHES, reason="no syscall table for this architecture")
def test_filter_refuses_namespaces_and_mounts_but_not_work() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert got == {
        "unshare": "EPERM", "setns": "EPERM", "mount": "EPERM", "clone-newuser": "EPERM",
        "clone3": "ENOSYS", "nested-unshare": "1", "work": "42",
    }  # fmt: skip


def test_program_shape() -> None:
    for machine in seccomp.ARCHES:
        prog = seccomp.program(machine)
        assert prog is not None and len(prog) % 8 == 0
        assert len(prog) // 8 < 256  # every jump offset fits in a u8
    assert seccomp.program("sparc64") is None
    numbers = [set(table) for _, table in seccomp.ARCHES.values()]
    assert all(set(seccomp.DENIED) | {"clone", "clone3"} == n for n in numbers)
