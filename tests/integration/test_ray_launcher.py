"""`agentrl run --launcher ray` on a simulated cluster (learner, gpu-like and two cpu nodes) in a
loopback-only namespace (the scenario is `ray_scenario.py`): roles placed by their resources (the
learner's two gloo ranks packed on the learner node), a roller actor killed and then its node
removed, a roller added by `agentrl scale`, a server actor killed, all mid-run; then the learner's
node removed, which ends the run with its last checkpoint, and `--resume` continues it on a new
learner node; the
per-group account across both lives still 0 lost / 0 trained twice / 0 credits leaked. And
(`ray_gpu_scenario.py`) two learner ranks asking for a GPU each on Ray's fake GPUs: each is told
its own GPU, and refuses to start when it cannot see it. And (`ray_colocated_scenario.py`)
`mode: colocated`: its ranks in one placement group, the learner node's loss ending the run
with its checkpoint, `--resume` continuing it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.launch.netns import netns_argv, netns_available
from agentrl.launch.progress import staleness
from agentrl.log import read_metrics
from agentrl.queue.account import account
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def run_scenario(script: str, model: Path, run_dir: Path, timeout_s: float) -> tuple[dict, str]:
    """Run `tests/integration/<script>` in a loopback-only namespace; its JSON line of findings and
    the tail of the run's driver log."""
    pytest.importorskip("ray", reason="ray is not installed (make setup installs the ray extra)")
    why = netns_available()
    if why:
        pytest.skip(f"Ray tests need a loopback-only network namespace: {why}")
    scenario = [sys.executable, str(REPO / "tests/integration" / script), str(model), str(run_dir)]
    result = subprocess.run(netns_argv(scenario), capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    driver = (
        (run_dir / "driver.log").read_text(errors="replace")[-4000:]
        if (run_dir / "driver.log").exists()
        else ""
    )
    assert result.returncode == 0 and lines, result.stderr[-4000:] + driver
    return json.loads(lines[-1]), driver


@pytest.mark.timeout(900)
def test_ray_launcher_places_by_resources_survives_actor_node_and_learner_loss(
    tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    out, driver = run_scenario("ray_scenario.py", tiny_model, run_dir, 840)
    assert out["returncode"] == 0, driver

    # placed where the resources said (node ids from Ray's state API)
    placement = out["placement"]
    assert {k: placement[k] for k in ("server0", "learner", "learner-rank1")} == {
        "server0": "gpu", "learner": "learner", "learner-rank1": "learner"
    }, placement  # fmt: skip
    assert placement["roller0"] in ("cpu", "cpu2") and len(placement) == 4, placement
    assert out["roller_restart_node"] == "other"  # its node gone, the roller came back on the one that fits
    # every fault hit the run mid-way (the first life cannot end by itself), and it trained on past them
    assert out["ckpt_at_kill"] > out["steps_at_faults"][-1], out
    assert out["scale"] == "agentrl scale: rollers 2", out["scale"]
    assert out["scaled_nodes"]["roller1"] == "other" and out["scaled_nodes"]["roller0"] == "other"
    for name in ("server0", "learner", "roller0", "roller1", "running"):
        assert name in out["status"], out["status"]
    assert out["orphans"] == []  # a killed actor's process died with it
    restarts = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    assert [r["child"] for r in restarts] == ["roller0", "roller0", "server0"]

    # the learner lost: the run ended at once (exit 1), naming the learner and its last checkpoint,
    # which both ranks wrote; `--resume` continued from it to the end
    assert out["first_life_rc"] == 1, driver
    assert "learner" in out["lost_message"] and out["ckpt_dir"] in out["lost_message"], out["lost_message"]
    assert "--resume" in out["lost_message"]
    assert {"rank0.pt", "rank1.pt"} <= set(out["ckpt_ranks"]), out["ckpt_ranks"]
    second = (run_dir / "driver2.log").read_text(errors="replace")
    for rank in ("learner", "learner-rank1"):  # both ranks on the new learner node
        assert f"started {rank} on 127.0.0.1 (node {out['resumed_on'][:8]}" in second, second[-4000:]

    # it learned like the local launcher's run: every step trained, staleness within k, every server updated
    learner = read_metrics(run_dir / "learner.jsonl")
    steps = [r["step"] for r in learner]
    final, ckpt = out["final_step"], out["ckpt_at_kill"]
    assert sorted(set(steps)) == list(range(1, final + 1)) and steps[-1] == final, steps
    assert steps[out["steps_at_kill"]] == ckpt + 1, (
        steps
    )  # the second life's first step follows the checkpoint
    assert all(staleness(r)[1] is not None and staleness(r)[1] <= 1 for r in learner)
    assert learner[-1]["sync/servers_dropped"] == 0 and learner[-1]["sync/servers_updated"] == 1
    acct = account(run_dir)  # both lives
    assert (acct.lost, acct.duplicated, acct.leaked_credits) == (0, 0, 0), acct.summary()
    assert acct.lost_undurable == 0 and all(r == (0, 0) for r in acct.step_residuals), acct.summary()

    # the secret was in no Ray state (what the dashboard shows), command line or log
    assert not out["secret_in_ray_state"] and not out["secret_in_cmdlines"] and not out["secret_in_logs"]
    # Ray's own shutdown left nothing behind that had to be stopped by PID, and nothing survived that
    assert out["left_after_kill"] == [], out


@pytest.mark.timeout(600)
def test_ray_gives_each_learner_rank_its_own_gpu_and_a_rank_without_cuda_refuses(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two ranks asking `{GPU: 1}` on a node with two fake GPUs (`ray_gpu_scenario.py`): each is told
    `cuda:0` with its own GPU id in CUDA_VISIBLE_DEVICES (not its index on the node, which its
    process could not see), and, finding no CUDA device, refuses to start instead of training on
    the CPU; the run ends with an error."""
    out, driver = run_scenario("ray_gpu_scenario.py", tiny_model, tmp_path / "run", 560)
    assert out["returncode"] == 1, driver
    ranks, ids = zip(*out["gpu_ids"], strict=True)  # the driver's log: what Ray gave each rank's actor
    assert sorted(ranks) == ["0", "1"] and sorted(ids) == ["0", "1"], driver
    # the first rank to refuse ends the run, so the other may be stopped before it writes a line
    # (seen on a loaded machine): every rank that wrote refused, and at least one did
    names = ("learner", "learner-rank1")
    started = [n for n in names if out[n]["tail"].strip()]
    refused = [out[n]["refused"] for n in started]
    assert refused and all(r is not None for r in refused), [out[n]["tail"] for n in names]
    assert {r[0] for r in refused} == {"cuda:0"} and {r[1] for r in refused} == {"0"}
    seen = [r[2] for r in refused]
    assert len(set(seen)) == len(seen) and set(seen) <= {"0", "1"}  # each rank sees only its own GPU
    assert not out["learner"]["on_cpu"] and not out["learner-rank1"]["on_cpu"]


@pytest.mark.timeout(700)
def test_ray_launcher_runs_a_colocated_run_that_ends_with_its_checkpoint_and_resumes(
    tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    out, driver = run_scenario("ray_colocated_scenario.py", tiny_model, run_dir, 660)
    # both ranks (rank 0 `learner`, rank 1 `learner-rank1`) on the learner node, nothing else started
    assert out["placement"] == [["learner", "learner"], ["learner-rank1", "learner"]], out["placement"]
    assert out["first_life_rc"] == 1 and out["ckpt_at_kill"] >= 2, out
    assert out["ckpt_dir"] in out["lost_message"] and "--resume" in out["lost_message"], out["lost_message"]
    assert out["returncode"] == 0 and out["resumed"], driver
    # the second life went on from the checkpoint: every version once from there to the end
    after = [s for s in out["steps"] if s > out["ckpt_at_kill"]]
    assert after[-2:] == [out["ckpt_at_kill"] + 1, out["final_step"]], out["steps"]
    assert out["left_after_kill"] == [], out["left_after_kill"]
