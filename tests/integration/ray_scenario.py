"""The Ray launcher's Done-when scenario, run inside a loopback-only namespace (`ray_netns.py`):

    python tests/integration/ray_netns.py ... python tests/integration/ray_scenario.py MODEL RUN_DIR

1. a `ray.cluster_utils.Cluster`: head `gpu`-like, a `learner` node (two ranks' worth), two
   `cpu` nodes;
2. `agentrl run --launcher.type ray` of the quickstart on the tiny model with a learner of two
   gloo ranks, each role asking for its node's custom resource; once it trains, where each actor
   ran is read from Ray's state API;
3. faults mid-run: ray.kill of the roller actor, then the node it came back on is removed (it
   restarts on the other `cpu` node); `agentrl scale --rollers 2` adds a roller and `agentrl
   status` shows the processes; then ray.kill of the server actor; then the learner's node is
   removed, which ends the run (exit 1) naming its last checkpoint;
4. a new `learner` node joins and `agentrl run --launcher.type ray --resume` on the same cluster
   continues from that checkpoint to `learner.max_steps` (given then: the first life's cannot end
   before the faults);
5. after the run: what Ray's state API (the dashboard's source) and every command line showed,
   searched for the queue's secret; Ray stopped, then every process left in the namespace stopped
   by PID and counted.
Prints one JSON line of findings for `test_ray_launcher.py` to check.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors, list_jobs, list_nodes, list_tasks

from agentrl.launch.ray import ray_namespace

STEPS_AFTER_RESUME = 2


def _wait(what: str, cond, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"agentrl run exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _state(list_fn, **kwargs) -> list:
    """A Ray state-API listing, retried: on a loaded machine its GCS client can time out
    ("Timed out while waiting for GCS to become available") while the cluster is fine."""
    for attempt in range(5):
        try:
            return list_fn(**kwargs)
        except ray.exceptions.RpcError:
            if attempt == 4:
                raise
            time.sleep(2.0 * (attempt + 1))
    raise AssertionError("unreachable")


def _steps(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "learner.jsonl").read_text().splitlines() if line.startswith("{"))
    except OSError:
        return 0


def _checkpoint(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0: none)."""
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def _restarts(run_dir: Path, name: str) -> list[dict]:
    try:
        lines = (run_dir / "launcher.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r["child"] == name]


def _start_cluster(tries: int = 3):
    """Head `gpu`, a `learner` node, two `cpu` nodes. Ray gives a raylet 30 s (hard-coded in
    ray/_private/node.py) to register, which a loaded machine can miss: then every process of
    the attempt is stopped by PID and the cluster started afresh."""
    for attempt in range(tries):
        try:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"gpu": 1}})
            learner = cluster.add_node(num_cpus=1, resources={"learner": 2})
            cpus = [cluster.add_node(num_cpus=1, resources={"cpu": 2}) for _ in range(2)]  # rollers' nodes
            cluster.wait_for_nodes()
            return cluster, learner, cpus
        except Exception as exc:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(exc) or attempt == tries - 1:
                raise
            print(f"cluster start {attempt + 1} timed out; again", file=sys.stderr)
            _stop_the_rest()
    raise AssertionError("unreachable")


def main(model: str, run_dir: Path) -> dict:
    out: dict = {}
    t0 = time.monotonic()
    cluster, learner_node, cpus = _start_cluster()
    ray.init(address=cluster.address)
    out["cluster_start_s"] = time.monotonic() - t0
    node_of = {"learner": learner_node.node_id, "gpu": cluster.head_node.node_id, "cpu": cpus[0].node_id}
    node_of["cpu2"] = cpus[1].node_id
    secret = secrets.token_hex(32)
    argv = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        "--launcher.type=ray", f"--launcher.address={cluster.address}", "--learner.resources={learner: 1}",
        "--inference.resources={gpu: 1}", "--roller.resources={cpu: 1}", "--learner.num_processes=2",
        "--launcher.restart_backoff_s=0.2", f"--learner.model_path={model}", "--learner.checkpoint.every=1",
        "--queue.durable=true", "--learner.groups_per_step=2", "--learner.warmstart.steps=0",
        "--roller.group_size=4", "--roller.max_turns=2", "--roller.max_concurrent_episodes=16",
        "--queue.heartbeat_s=0.5", "--queue.roller_lease_s=3", "--roller.shutdown_grace_s=2",
    ]  # fmt: skip
    env = {**os.environ, "AGENTRL_QUEUE_SECRET": secret}
    log = (run_dir / "driver.log").open("w")
    proc = subprocess.Popen(
        [*argv, "--learner.max_steps=1000"], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        _wait("the first trained steps", lambda: _steps(run_dir) >= 2, proc)
        out["first_steps_s"] = time.monotonic() - t0
        ns = ray_namespace(run_dir)
        actors = {
            a.name: a.node_id
            for a in _state(list_actors, filters=[("state", "=", "ALIVE")])
            if a.ray_namespace == ns
        }
        out["placement"] = {
            name: next((k for k, v in node_of.items() if v == nid), nid) for name, nid in actors.items()
        }
        out["steps_at_faults"] = [_steps(run_dir)]

        ray.kill(ray.get_actor("roller0", namespace=ns), no_restart=False)
        _wait("roller0's restart", lambda: len(_restarts(run_dir, "roller0")) >= 1, proc)
        # the rollers' node is lost: roller0 comes back on the other node that offers `cpu`
        lost = next(n for n in cpus if n.node_id == _restarts(run_dir, "roller0")[-1]["node_id"])
        other = next(n for n in cpus if n is not lost)
        out["steps_at_faults"].append(_steps(run_dir))
        cluster.remove_node(lost)
        _wait("roller0 on the other cpu node", lambda: len(_restarts(run_dir, "roller0")) >= 2, proc)
        out["roller_restart_node"] = (
            "other" if _restarts(run_dir, "roller0")[-1]["node_id"] == other.node_id else "same"
        )
        # elastic: a second roller while the run goes on (the learner is not restarted)
        agentrl = [sys.executable, "-m", "agentrl"]
        scaled = subprocess.run(
            [*agentrl, "scale", "--run-dir", str(run_dir), "--rollers", "2"], capture_output=True, text=True
        )
        out["scale"] = scaled.stdout.strip() + scaled.stderr.strip()[-500:]
        wide = {**os.environ, "COLUMNS": "200"}
        status = subprocess.run(
            [*agentrl, "status", "--run-dir", str(run_dir)], capture_output=True, text=True, env=wide
        )
        out["status"] = status.stdout
        state = json.loads((run_dir / "launcher_state.json").read_text())
        out["scaled_nodes"] = {
            p["name"]: "other" if p.get("node_id") == other.node_id else p.get("node_id")
            for p in state["processes"]
        }
        out["steps_at_faults"].append(_steps(run_dir))
        ray.kill(ray.get_actor("server0", namespace=ns), no_restart=False)
        _wait("server0's restart", lambda: len(_restarts(run_dir, "server0")) >= 1, proc)
        # the processes of the killed actors died with them (PR_SET_PDEATHSIG), by the PIDs the driver logged
        started = re.findall(r"started (\S+) on .* pid (\d+)\)", (run_dir / "driver.log").read_text())
        latest = {name: pid for name, pid in started}
        out["orphans"] = [f"{n} {p}" for n, p in started if latest[n] != p and _running(int(p))]

        # the learner lost: its node removed once a checkpoint is written after the faults
        at = _steps(run_dir)
        _wait("a checkpoint after the faults", lambda: _checkpoint(run_dir) > at, proc)
        out["ckpt_ranks"] = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*/rank*.pt"))
        cluster.remove_node(learner_node)
        out["first_life_rc"] = proc.wait(timeout=180)  # bounded: the end is prompt, not a hang
        out["ckpt_at_kill"], out["steps_at_kill"] = _checkpoint(run_dir), _steps(run_dir)
        lost = [ln for ln in (run_dir / "driver.log").read_text().splitlines() if "learner lost" in ln]
        out["lost_message"] = lost[-1] if lost else ""
        out["ckpt_dir"] = str(run_dir / "checkpoints" / f"step_{out['ckpt_at_kill']:08d}")

        # its second life: a new learner node, --resume on the same cluster, to a few steps past the checkpoint
        out["resumed_on"] = cluster.add_node(num_cpus=1, resources={"learner": 2}).node_id
        cluster.wait_for_nodes()
        final = out["ckpt_at_kill"] + STEPS_AFTER_RESUME
        out["final_step"] = final
        log.close()
        log = (run_dir / "driver2.log").open("w")
        proc = subprocess.Popen([*argv, f"--learner.max_steps={final}", "--resume"], stdout=log,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
        out["returncode"] = proc.wait(timeout=300)
        text = json.dumps([a.__dict__ for a in _state(list_actors, detail=True)], default=str)
        text += json.dumps([t.__dict__ for t in _state(list_tasks, detail=True, limit=10000)], default=str)
        text += json.dumps(
            [j.__dict__ if hasattr(j, "__dict__") else j for j in _state(list_jobs)], default=str
        )
        text += json.dumps([n.__dict__ for n in _state(list_nodes, detail=True)], default=str)
        out["secret_in_ray_state"] = secret in text
        out["secret_in_cmdlines"] = any(secret in _cmdline(pid) for pid in _pids())
        out["secret_in_logs"] = any(secret in p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    finally:
        out["cluster_shutdown_hung"] = shut_down(proc, log, cluster)
    out["left_after_shutdown"], out["left_after_kill"] = _stop_the_rest()
    return out


def shut_down(proc: subprocess.Popen, log: Any, cluster: Cluster) -> bool:
    """Stop the run (SIGTERM), then Ray and the cluster; True when the cluster's shutdown hung."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    log.close()
    ray.shutdown()
    # bounded: what Ray's own shutdown leaves (or does not stop in time) is stopped by PID below
    stopper = threading.Thread(target=cluster.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=90)
    return stopper.is_alive()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead process nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
