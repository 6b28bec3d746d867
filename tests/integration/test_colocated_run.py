"""`agentrl run` in `mode: colocated`: 2 real gloo ranks generate, reshard, train and export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import run_agentrl

pytestmark = pytest.mark.slow


def test_colocated_run_trains_on_policy_with_per_phase_metrics(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", "recipes/quickstart_colocated.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0", "--learner.max_steps=2",
        "--learner.groups_per_step=2", "--roller.group_size=2", "--roller.max_new_tokens=8",
        # ReMax: the roller's own group code runs each group's greedy episode on the replica
        "--learner.loss.advantage=remax", "--roller.greedy_baseline=true",
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(run_dir / "learner.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["time/generation_s"] > 0 and r["time/reshard_s"] > 0 and r["time/train_s"] > 0
        assert r["reshard/collectives"] > 0  # the all-gathers inside the micro-DP group (dg=2)
        assert r["memory/peak_rss_bytes_rank0"] > 0 and r["memory/peak_rss_bytes_rank1"] > 0
        assert r["staleness/max"] == 0  # generated at version v, trained at version v
        assert r["groups_consumed"] > 0
        assert r["roller/greedy_episodes"] == 1  # rank 0's replica: one group per step, one greedy episode
    assert (run_dir / "hf" / "latest" / "config.json").exists()


LR = 1e-3
STEPS = 2  # the second step generates on the weights the first one updated
# (t, tg): FSDP2 + TP over both ranks (d = 1; tg = 2, dg = 1: every generation parameter a view
# of its training shard), then FSDP2 over both ranks (t = 1) replaying the same groups
LAYOUTS = ((2, 2), (1, 2))


def _tp_worker(rank: int, world: int, port: int, model: str, out_dir: str) -> None:
    import torch.distributed as dist

    from agentrl.colocated.loop import ColocatedRank
    from agentrl.config import load_config
    from agentrl.hybrid.procs import init_gloo
    from agentrl.learner.bookkeeping import export

    init_gloo(rank, world, port)
    steps: list[list] = []
    results = []
    for t, tg in LAYOUTS:
        args = [f"--run_dir={out_dir}/t{t}", f"--learner.model_path={model}", "--learner.warmstart.steps=0",
                "--learner.groups_per_step=2", "--learner.mini_batches=2", f"--learner.optim.lr={LR}",
                "--roller.group_size=4",
                "--roller.max_new_tokens=8", "--learner.micro_batch_tokens=64",
                f"--colocated.t={t}", f"--colocated.tg={tg}"]  # fmt: skip
        cfg = load_config("recipes/quickstart_colocated.yaml", args, uses=("learner", "roller", "env"))
        r = ColocatedRank(cfg)
        try:
            for step in range(STEPS):
                if t == LAYOUTS[0][0]:
                    groups, _ = r.generate()
                    # the untrained model earns no reward: rewards set here, so that the
                    # advantages (and the loss and gradients compared below) are not all zero
                    for group in groups:
                        for i, episode in enumerate(group.episodes):
                            episode.reward = float(i % 2)
                    steps.append(groups)
                m = r.train(steps[step])
                tokens = sum(int(e.loss_mask.sum()) for g in steps[step] for e in g.episodes)
                keys = ("loss", "grad_norm", "loss_tokens", "mismatch_kl/k3", "ratio_mean", "step_skipped")
                results.append({"t": t, "step": step, "tokens": tokens, **{k: m[k] for k in keys}})
            export(r.learner)  # the full weights gathered from the (dp, tp) shards
        finally:
            r.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def test_colocated_tp_training_equals_fsdp_training(tiny_model: Path, tmp_path: Path) -> None:
    """FSDP2 + TP (colocated.t = 2) trains the same steps as FSDP2 alone (t = 1) on the same groups:
    the loss is normalised over the dp ranks only, the batch is split by dp index (both TP ranks
    feed the same micro-batches; split by rank, each would see half the tokens) and the gradient
    norm spans both meshes; generation at t = 2 follows the trained weights (mismatch ~0)."""
    from safetensors.torch import load_file

    from agentrl.hybrid.procs import run_ranks

    run_ranks(_tp_worker, 2, (str(tiny_model), str(tmp_path)), 280, "the colocated t=2 vs t=1 test")
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1]  # every rank reports the same step metrics
    tp = [r for r in per_rank[0] if r["t"] == 2]
    fsdp = [r for r in per_rank[0] if r["t"] == 1]
    assert len(tp) == len(fsdp) == STEPS
    for a, b in zip(tp, fsdp, strict=True):
        assert a["step_skipped"] == b["step_skipped"] == 0
        # two mini-batches per step: over both, each loss token counted once
        assert 2 * a["loss_tokens"] == 2 * b["loss_tokens"] == a["tokens"] > 0
        # something to compare: the second mini-batch's ratios are off 1 (weights moved)
        assert a["grad_norm"] > 1e-3 and abs(a["loss"]) > 1e-6
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, b["grad_norm"]), (a, b)
        # the engine generated on the weights being trained (t = 2), and the t = 1 learner holds
        # the same weights as the t = 2 one at every step
        assert a["mismatch_kl/k3"] < 1e-6 and b["mismatch_kl/k3"] < 1e-6, (a, b)
        assert abs(a["ratio_mean"] - b["ratio_mean"]) < 1e-5
    # the exported checkpoints hold the same trained weights. AdamW moves each weight by about lr
    # per update whatever its gradient's size, so fp32 noise in a near-zero gradient shows up as a
    # small fraction of lr (1.6e-5 seen at lr 1e-3); a wrong split or scale moves weights by ~lr
    tensors = [load_file(tmp_path / f"t{t}" / "hf" / "latest" / "model.safetensors") for t, _ in LAYOUTS]
    assert tensors[0].keys() == tensors[1].keys()
    for name, value in tensors[0].items():
        assert (value - tensors[1][name]).abs().max() < 0.05 * LR, name
