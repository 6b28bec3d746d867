"""A command line that runs in a private network namespace whose only interface is loopback, for
the Ray tests and `agentrl bench launch` (Ray registers and connects to the machine's own
interface address otherwise, even when told 127.0.0.1).

`unshare --net --pid --fork --mount-proc` (needs root or user namespaces) with `ip link set lo
up`: the command runs under a bash that is PID 1 of its own PID namespace, so every process it
starts is in that namespace, and the kernel kills what is left when it exits.
"""

from __future__ import annotations

import shutil
import subprocess


def netns_argv(argv: list[str]) -> list[str]:
    inner = "ip link set lo up && " + " ".join(_quote(a) for a in argv)
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c", inner]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def netns_available() -> str | None:
    """None when a loopback-only namespace can be made here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    probe = subprocess.run(netns_argv(["ip", "-br", "addr"]), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --net is not permitted here: {probe.stderr.strip()[-200:]}"
    if [line.split()[0] for line in probe.stdout.splitlines() if line.strip()] != ["lo"]:
        return f"the namespace has more than lo: {probe.stdout!r}"
    return None
