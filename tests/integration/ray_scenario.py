"""The Ray launcher's Done-when scenario, run inside a loopback-only namespace (`ray_netns.py`):

    python tests/integration/ray_netns.py ... python tests/integration/ray_scenario.py MODEL RUN_DIR

1. a 3-node `ray.cluster_utils.Cluster`: head `learner`, a `gpu`-like node, a `cpu` node;
2. `agentrl run --launcher.type ray` of the quickstart on the tiny model, each role asking for
   its node's custom resource; once it trains, where each actor ran is read from Ray's state API;
3. faults mid-run: ray.kill of the roller actor, then of the server actor, then the rollers'
   node is removed (a fresh `cpu` node joins for the roller to restart on);
4. after the run: what Ray's state API (the dashboard's source) and every command line showed,
   searched for the queue's secret; Ray stopped, then every process left in the namespace stopped
   by PID and counted.
Prints one JSON line of findings for `test_ray_launcher.py` to check.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")  # a loaded 2-core machine: nodes start slowly
import contextlib

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors, list_jobs, list_nodes, list_tasks

from agentrl.launch.ray import ray_namespace

STEPS = 10


def _wait(what: str, cond, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"agentrl run exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _steps(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "learner.jsonl").read_text().splitlines() if line.startswith("{"))
    except OSError:
        return 0


def _restarts(run_dir: Path, name: str) -> list[dict]:
    try:
        lines = (run_dir / "launcher.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r["child"] == name]


def main(model: str, run_dir: Path) -> dict:
    out: dict = {}
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"learner": 1}})
    gpu = cluster.add_node(num_cpus=1, resources={"gpu": 1})
    cpu = cluster.add_node(num_cpus=1, resources={"cpu": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    out["cluster_start_s"] = time.monotonic() - t0
    node_of = {"learner": cluster.head_node.node_id, "gpu": gpu.node_id, "cpu": cpu.node_id}
    secret = secrets.token_hex(32)
    resources = "{learner: {learner: 1}, server: {gpu: 1}, roller: {cpu: 1}}"
    argv = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        "--launcher.type=ray", f"--launcher.address={cluster.address}", f"--launcher.resources={resources}",
        "--launcher.restart_backoff_s=0.2", f"--learner.model_path={model}", f"--learner.max_steps={STEPS}",
        "--learner.groups_per_step=2", "--learner.warmstart_steps=0", "--roller.group_size=4",
        "--roller.max_turns=2", "--roller.max_concurrent_episodes=16", "--queue.heartbeat_s=0.5",
        "--queue.roller_lease_s=3",
    ]  # fmt: skip
    env = {**os.environ, "AGENTRL_QUEUE_SECRET": secret}
    log = (run_dir / "driver.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait("the first trained steps", lambda: _steps(run_dir) >= 2, proc)
        out["first_steps_s"] = time.monotonic() - t0
        ns = ray_namespace(run_dir)
        actors = {
            a.name: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.ray_namespace == ns
        }
        out["placement"] = {
            name: next((k for k, v in node_of.items() if v == nid), nid) for name, nid in actors.items()
        }

        ray.kill(ray.get_actor("roller0", namespace=ns), no_restart=False)
        _wait("roller0's restart", lambda: len(_restarts(run_dir, "roller0")) >= 1, proc)
        ray.kill(ray.get_actor("server0", namespace=ns), no_restart=False)
        _wait("server0's restart", lambda: len(_restarts(run_dir, "server0")) >= 1, proc)
        out["steps_before_node_loss"] = _steps(run_dir)
        spare = cluster.add_node(num_cpus=1, resources={"cpu": 1})
        cluster.remove_node(cpu)
        _wait("roller0 on the spare node", lambda: len(_restarts(run_dir, "roller0")) >= 2, proc)
        out["roller_restart_node"] = (
            "spare" if _restarts(run_dir, "roller0")[-1]["node_id"] == spare.node_id else "other"
        )
        out["returncode"] = proc.wait(timeout=300)
        text = json.dumps([a.__dict__ for a in list_actors(detail=True)], default=str)
        text += json.dumps([t.__dict__ for t in list_tasks(detail=True, limit=10000)], default=str)
        text += json.dumps([j.__dict__ if hasattr(j, "__dict__") else j for j in list_jobs()], default=str)
        text += json.dumps([n.__dict__ for n in list_nodes(detail=True)], default=str)
        out["secret_in_ray_state"] = secret in text
        out["secret_in_cmdlines"] = any(secret in _cmdline(pid) for pid in _pids())
        out["secret_in_logs"] = any(secret in p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        log.close()
        ray.shutdown()
        cluster.shutdown()
    out["left_after_shutdown"], out["left_after_kill"] = _stop_the_rest()
    return out


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stop_the_rest() -> tuple[list[str], list[str]]:
    """Every process still in this PID namespace (ours alone) after Ray's shutdown, stopped by PID."""
    time.sleep(1)
    left = {pid: _cmdline(pid)[:80] for pid in _pids() if _cmdline(pid)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(2)
        for pid in left:  # reap what we parented
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    return sorted(left.values()), [c for pid in left if (c := _cmdline(pid))]


if __name__ == "__main__":
    run_dir = Path(sys.argv[2]).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(sys.argv[1], run_dir)), flush=True)
