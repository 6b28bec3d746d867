"""Ray's GPU placement of learner ranks, on a CPU machine with Ray's fake GPUs, in a loopback-only
namespace (run by `test_ray_launcher.py`):

    python tests/integration/ray_gpu_scenario.py MODEL RUN_DIR

A one-node `ray.cluster_utils.Cluster` that says it has 2 GPUs (`num_gpus=2`: Ray schedules and
assigns them, and sets each actor's CUDA_VISIBLE_DEVICES, but none exists); `agentrl run
--launcher.type ray` with two learner ranks asking `{GPU: 1}` each, packed on that node. Each
rank must be told its own first GPU (`AGENTRL_DEVICE=cuda:0`, with CUDA_VISIBLE_DEVICES its own
id), not its index on the node, and, seeing no CUDA device, refuse to start naming what it was
given, rather than train on the CPU. Prints one JSON line of findings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_scenario import _stop_the_rest


def main(model: str, run_dir: Path) -> dict:
    out: dict = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    ray.init(address=cluster.address)
    argv = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        "--launcher.type=ray", f"--launcher.address={cluster.address}", "--learner.resources={GPU: 1, CPU: 1}",
        "--inference.resources={CPU: 1}", "--roller.resources={CPU: 1}", "--learner.num_processes=2",
        f"--learner.model_path={model}", "--learner.warmstart.steps=0", "--learner.max_steps=2",
    ]  # fmt: skip
    try:
        with (run_dir / "driver.log").open("w") as log:
            out["returncode"] = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, timeout=400
            ).returncode
        out["driver"] = (run_dir / "driver.log").read_text(errors="replace")[-3000:]
        for name in ("learner", "learner-rank1"):
            text = (run_dir / "logs" / f"{name}.log").read_text(errors="replace")
            refused = re.search(r"AGENTRL_DEVICE=(\S+) \(the GPU its launcher gave it\) but this process sees "
                                r"(\d+) CUDA device\(s\) \(CUDA_VISIBLE_DEVICES='([^']*)'\)", text)  # fmt: skip
            out[name] = {
                "refused": refused.groups() if refused else None,
                "on_cpu": bool(re.search(r"rank \d+ of \d+ on cpu", text)),
                "tail": text[-1500:],
            }
        out["gpu_ids"] = re.findall(r"learner rank (\d+): Ray gave GPU id\(s\) \['(\d+)'\]", out["driver"])
    finally:
        ray.shutdown()
        stopper = threading.Thread(target=cluster.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout=90)
    out["left_after_shutdown"], _ = _stop_the_rest()
    return out


if __name__ == "__main__":
    run_dir = Path(sys.argv[2]).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    print(json.dumps(main(sys.argv[1], run_dir)), flush=True)
