"""`mode: colocated` under the Ray launcher, run inside a loopback-only namespace
(`agentrl.launch.netns`, as `ray_scenario.py`):

    python tests/integration/ray_colocated_scenario.py MODEL RUN_DIR

1. a `ray.cluster_utils.Cluster`: a head with no `learner` resource and one `learner` node (two
   ranks' worth);
2. `agentrl run --config recipes/quickstart_colocated.yaml --launcher.type ray` on the tiny model:
   the two colocated ranks in one placement group on the learner node; once its checkpoint of
   version 2 is written, the learner node is removed, which ends the run (exit 1) naming that
   checkpoint;
3. a new `learner` node joins and `--resume` on the same cluster continues from the checkpoint to
   `learner.max_steps`;
4. Ray stopped, then every process left in the namespace stopped by PID.
Prints one JSON line of findings for `test_ray_launcher.py` to check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from ray_scenario import _checkpoint, _state, _steps, _stop_the_rest, _wait, shut_down  # this script's folder

from agentrl.launch.ray import ray_namespace
from agentrl.log import read_metrics


def main(model: str, run_dir: Path) -> dict:
    out: dict = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    learner_node = cluster.add_node(num_cpus=2, resources={"learner": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    argv = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart_colocated.yaml",
        f"--run_dir={run_dir}", "--launcher.type=ray", f"--launcher.address={cluster.address}",
        "--learner.resources={learner: 1}", f"--learner.model_path={model}", "--learner.warmstart.steps=0",
        "--learner.checkpoint.every=2", "--learner.groups_per_step=2", "--roller.group_size=2",
        "--roller.max_new_tokens=8", "--learner.loss.entropy_coef=0.05",
    ]  # fmt: skip
    log = (run_dir / "driver.log").open("w")
    proc = subprocess.Popen([*argv, "--learner.max_steps=1000"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait("the checkpoint of version 2", lambda: _checkpoint(run_dir) >= 2, proc)
        ns = ray_namespace(run_dir)
        out["placement"] = sorted(
            (a.name, "learner" if a.node_id == learner_node.node_id else "other")
            for a in _state(list_actors, filters=[("state", "=", "ALIVE")])
            if a.ray_namespace == ns
        )
        cluster.remove_node(learner_node)
        out["first_life_rc"] = proc.wait(timeout=180)  # bounded: the end is prompt, not a hang
        out["ckpt_at_kill"], out["steps_at_kill"] = _checkpoint(run_dir), _steps(run_dir)
        lost = [ln for ln in (run_dir / "driver.log").read_text().splitlines() if "learner lost" in ln]
        out["lost_message"] = lost[-1] if lost else ""
        out["ckpt_dir"] = str(run_dir / "checkpoints" / f"step_{out['ckpt_at_kill']:08d}")

        cluster.add_node(num_cpus=2, resources={"learner": 2})
        cluster.wait_for_nodes()
        out["final_step"] = final = out["ckpt_at_kill"] + 2
        log.close()
        log = (run_dir / "driver2.log").open("w")
        proc = subprocess.Popen([*argv, f"--learner.max_steps={final}", "--resume"], stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        out["returncode"] = proc.wait(timeout=300)
        ranks = sorted((run_dir / "logs").glob("learner*.log"))
        out["resumed"] = any("resumed at version" in p.read_text(errors="replace") for p in ranks)
        out["steps"] = [r["step"] for r in read_metrics(run_dir / "learner.jsonl")]
    finally:
        out["cluster_shutdown_hung"] = shut_down(proc, log, cluster)
    out["left_after_shutdown"], out["left_after_kill"] = _stop_the_rest()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_dir = Path(sys.argv[2]).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(sys.argv[1], run_dir)), flush=True)
