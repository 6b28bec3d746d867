"""What runs on the nodes of a Ray run: one `ProcessActor` per process of the plan (its child
is the `agentrl serve | learner | roller | retriever` command line a user would type on that
node), the actor options of a role's `resources`, and the threads its child may use. The driver
that creates and supervises these actors is `launch/ray.py`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


class ProcessActor:
    """One process of the run, on whatever node Ray placed this actor."""

    def __init__(self, name: str, log_path: str, cwd: str) -> None:
        self.name, self.log_path, self.cwd = name, log_path, cwd
        self.proc = None

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "actor_pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],  # what Ray gave it; its child sees only these
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }  # fmt: skip

    def bind_port(self, prefer: int = 0) -> int:
        """A port free on this node's address (`prefer` when it is free)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        for port in (prefer, 0) if prefer else (0,):
            with socket.socket() as s:
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
                )  # as servers bind: TIME_WAIT is no conflict
                try:
                    s.bind((ip, port))
                except OSError:
                    continue
                return s.getsockname()[1]
        raise OSError(f"no free port on {ip}")

    def write_servers(self, path: str, epoch: int, urls: list[str], services: dict | None = None) -> None:
        """Write the live server list (`inference.server_list`) on this node, for the learner's
        process here: nodes share no filesystem, so the driver hands it over by call."""
        from agentrl.inference import server_list

        server_list.write(path, epoch, urls, services)

    def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start `python -m agentrl *args` with `env` added (secrets arrive here, by call); it is
        killed with the actor (ray.kill, node lost), so none is left."""
        import functools
        import signal
        import subprocess

        from agentrl.launch.procs import die_with_parent

        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentrl", *args], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **env}, cwd=self.cwd,
                preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
            )  # fmt: skip
        return self.proc.pid

    def poll(self) -> dict[str, Any]:
        if self.proc is None:
            return {"started": False, "code": None, "pid": None}
        return {"started": True, "code": self.proc.poll(), "pid": self.proc.pid}

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after `timeout_s`; its exit code."""
        import signal
        import subprocess

        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        except ProcessLookupError:
            return self.proc.wait()


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options of a role's `resources` (CPU, GPU and custom resources)."""
    res = dict(resources)
    return {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0), "resources": res}


def child_threads(resources: dict[str, float]) -> dict[str, str]:
    """Intra-op threads of a process: the CPUs its role asks for, else 1, as the local launcher
    caps its children (oversubscribed OpenMP threads slow small models several-fold)."""
    n = str(max(1, int(resources.get("CPU", 1))))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
