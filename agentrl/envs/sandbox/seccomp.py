"""A seccomp filter for sandboxed code: no new namespaces, no mounts, no kernel-wide knobs.

bubblewrap needs these syscalls to build the sandbox and then loads this filter (`--seccomp
FD`) just before it runs the command, so the model's code — and everything it starts —
gets EPERM from `unshare`, `setns`, `mount` and friends (no nested `unshare -r -m`, no
remounting what bubblewrap made read-only), from the kernel keyring, `bpf`,
`perf_event_open`, `userfaultfd`, module loading, `kexec`, `open_by_handle_at` (the
classic container escape), swap, reboot and quota calls. `clone` is allowed only without
CLONE_NEW* flags; `clone3`, whose flags sit in memory a filter cannot read, gets ENOSYS so
libc falls back to `clone` (what Docker's and Flatpak's default profiles do). Syscalls of
another ABI (i386 `int 0x80` or x32 on x86-64) are refused outright.

The program is classic BPF assembled here — 8 bytes per instruction, `struct sock_filter`
of linux/filter.h — so neither libseccomp nor its Python bindings are needed.
"""

from __future__ import annotations

import errno
import platform
import struct

# linux/filter.h and linux/seccomp.h
LD_W_ABS, JEQ_K, JGE_K, AND_K, RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data (arg0's low word: little endian)
X32_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020080  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME

DENIED = (
    "unshare setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig fsmount fspick "
    "mount_setattr keyctl add_key request_key bpf perf_event_open userfaultfd kexec_load "
    "kexec_file_load init_module finit_module delete_module acct swapon swapoff reboot quotactl "
    "name_to_handle_at open_by_handle_at syslog"
).split()

# (audit arch, syscall numbers) from asm/unistd_64.h (x86-64) and asm-generic/unistd.h (arm64)
ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, dict(
        unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, open_tree=428,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, keyctl=250,
        add_key=248, request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, kexec_load=246,
        kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, acct=163, swapon=167,
        swapoff=168, reboot=169, quotactl=179, name_to_handle_at=303, open_by_handle_at=304, syslog=103,
        clone=56, clone3=435,
    )),
    "aarch64": (0xC00000B7, dict(
        unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, open_tree=428,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, keyctl=219,
        add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282, kexec_load=104,
        kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, acct=89, swapon=224,
        swapoff=225, reboot=142, quotactl=60, name_to_handle_at=264, open_by_handle_at=265, syslog=116,
        clone=220, clone3=435,
    )),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture as bytes for `bwrap --seccomp FD`, or None
    where the architecture is not one this module knows the syscall numbers of."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        return None
    arch, numbers = ARCHES[machine]
    deny = [numbers[name] for name in DENIED]
    # Layout: arch check, x32 check, one JEQ per denied syscall, clone, clone3, ALLOW, then the
    # shared tails. Jump offsets count instructions after the jumping one.
    body: list[tuple[int, int, str]] = [(JEQ_K, nr, "deny") for nr in deny]
    body += [(JEQ_K, numbers["clone"], "clone"), (JEQ_K, numbers["clone3"], "enosys")]
    head = [_insn(LD_W_ABS, OFFSET_ARCH)]
    n_head = 2 + 1 + (1 if machine == "x86_64" else 0)  # arch jeq, load nr, x32 jge
    allow_at = n_head + len(body)  # index of RET ALLOW after the head
    tails = {"allow": allow_at, "deny": allow_at + 1, "enosys": allow_at + 2, "clone": allow_at + 3}
    head.append(_insn(JEQ_K, arch, 0, tails["deny"] - 2))  # foreign ABI: refuse
    head.append(_insn(LD_W_ABS, OFFSET_NR))
    if machine == "x86_64":
        head.append(_insn(JGE_K, X32_BIT, tails["deny"] - 4, 0))
    code = head[:]
    for i, (op, k, target) in enumerate(body):
        code.append(_insn(op, k, tails[target] - (len(head) + i) - 1, 0))
    code.append(_insn(RET_K, RET_ALLOW))
    code.append(_insn(RET_K, RET_ERRNO | errno.EPERM))
    code.append(_insn(RET_K, RET_ERRNO | errno.ENOSYS))
    # clone: allowed unless a CLONE_NEW* flag is set
    code.append(_insn(LD_W_ABS, OFFSET_ARG0))
    code.append(_insn(AND_K, CLONE_NEW_FLAGS))
    code.append(_insn(JEQ_K, 0, 0, 1))
    code.append(_insn(RET_K, RET_ALLOW))
    code.append(_insn(RET_K, RET_ERRNO | errno.EPERM))
    return b"".join(code)
