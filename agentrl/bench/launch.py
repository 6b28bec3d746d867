"""`agentrl bench launch`: the Ray launcher against the local one, on the same run, same machine.

    agentrl bench launch [--steps 12] [--model tiny]

Both arms run the shortened quickstart (no warm start, groups_per_step 2, group_size 4, one
server, one roller) on one fresh model: first `agentrl run` (local launcher), then `agentrl run
--launcher ray` against a one-node Ray cluster (`ray.cluster_utils.Cluster`, started before the
clock runs: a user's cluster is already up). The whole bench runs inside a loopback-only network
namespace (`launch/netns.py`; it re-executes itself there), as Ray must on these machines.

Per arm: seconds from `agentrl run` to the first trained step (`first_step_s`), and steady-state
episodes/s, from the learner's records after its first step: (steps − 1) × groups_per_step ×
group_size / (time of the last step − time of the first). Ratios, higher is better:
`ray_vs_local` (episodes/s, ray / local; goal ≥ 0.95) and `first_step_ray_vs_local` (local's
seconds / ray's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.bench.common import emit, print_table
from agentrl.log import read_metrics

REPO = Path(__file__).resolve().parents[2]
GROUPS, GROUP_SIZE = 2, 4


def _arm(model: str, run_dir: Path, steps: int, extra: list[str]) -> dict[str, float]:
    argv = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={model}", f"--learner.max_steps={steps}", f"--learner.groups_per_step={GROUPS}",
        "--learner.warmstart.steps=0", f"--roller.group_size={GROUP_SIZE}", "--roller.max_turns=2",
        "--roller.max_concurrent_episodes=16", *extra,
    ]  # fmt: skip
    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "bench.log").open("w") as log:
        code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if code != 0:
        raise RuntimeError(f"agentrl run {' '.join(extra)} exited {code}; see {run_dir / 'bench.log'}")
    records = read_metrics(run_dir / "learner.jsonl")
    first, last = records[0]["time"], records[-1]["time"]
    eps = (len(records) - 1) * GROUPS * GROUP_SIZE / (last - first) if last > first else float("nan")
    return {"first_step_s": first - start, "episodes_per_s": eps}


def _cluster(cluster_cls, tries: int = 3):
    """A one-node cluster; Ray gives its raylet 30 s to register (hard-coded), which a loaded
    machine can miss, so it is tried again (what a failed try left dies with the namespace)."""
    for attempt in range(tries):
        try:
            return cluster_cls(initialize_head=True, head_node_args={"num_cpus": os.cpu_count() or 2})
        except Exception as exc:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _inner(opts: argparse.Namespace) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from agentrl.tiny_model import init_model

    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        model = str(init_model(opts.model, Path(tmp) / "model"))
        local = _arm(model, Path(tmp) / "local", opts.steps, [])
        cluster = _cluster(Cluster)
        try:
            ray_arm = _arm(
                model,
                Path(tmp) / "ray",
                opts.steps,
                ["--launcher.type=ray", f"--launcher.address={cluster.address}"],
            )
        finally:
            ray.shutdown()
            cluster.shutdown()
    rows = [
        [name, f"{a['first_step_s']:.1f}", f"{a['episodes_per_s']:.2f}"]
        for name, a in (("local", local), ("ray", ray_arm))
    ]
    print_table(
        f"agentrl bench launch ({opts.steps} steps, {opts.model} model)",
        ["launcher", "first step (s)", "episodes/s"],
        rows,
    )
    metrics = {f"{k}_{name}": v for name, a in (("local", local), ("ray", ray_arm)) for k, v in a.items()}
    ratios = {
        "ray_vs_local": ray_arm["episodes_per_s"] / local["episodes_per_s"],
        "first_step_ray_vs_local": local["first_step_s"] / ray_arm["first_step_s"],
    }
    emit("launch", metrics, ratios)
    return 0


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench launch", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="learner steps per arm")
    parser.add_argument("--model", default="tiny", help="model preset (agentrl init-model)")
    opts = parser.parse_args(args)
    if os.environ.get("AGENTRL_BENCH_NETNS") == "1":
        return _inner(opts)
    from agentrl.launch.netns import netns_argv, netns_available

    why = netns_available()
    if why:
        print(
            f"agentrl bench launch: needs a loopback-only network namespace for Ray: {why}", file=sys.stderr
        )
        return 2
    argv = netns_argv(
        ["env", "AGENTRL_BENCH_NETNS=1", sys.executable, "-m", "agentrl", "bench", "launch", *args]
    )
    return subprocess.run(argv, cwd=REPO).returncode
