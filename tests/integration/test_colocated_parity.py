"""The colocated ranks and the decoupled loop run one learner step (`learner.step`): on the same
groups, 2 real gloo ranks reach the same losses, gradient norms and weights either way: GRPO,
GRPO with a KL penalty to a reference model, and PPO with a critic and GAE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

VARIANTS = {
    "grpo": [],
    "kl": ["--learner.loss.kl_coef=0.05", "--learner.loss.off_policy=decoupled"],
    "gae": ["--learner.loss.advantage=gae", "--learner.critic.optim.lr=1e-3"],
}
KEYS = ("loss", "grad_norm", "kl_ref", "critic/value_loss", "critic/grad_norm", "adv/gae_std")


class Recorder:
    """The loop's metrics sink (rank 0), in memory."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, m: dict, step: int) -> None:
        self.rows.append(dict(m))


def _worker(rank: int, world: int, port: int, model: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from agentrl.colocated.loop import ColocatedRank
    from agentrl.config import load_config
    from agentrl.hybrid.procs import init_gloo
    from agentrl.learner.fsdp import full_state_dict
    from agentrl.learner.loop import build_learner, run
    from tests.unit.learner.source import ListSource, make_groups

    init_gloo(rank, world, port)
    results = {}
    for name, extra in VARIANTS.items():
        args = [f"--run_dir={out_dir}/{name}", f"--learner.model_path={model}", "--learner.warmstart.steps=0",
                "--learner.groups_per_step=2", "--learner.max_steps=2", "--learner.mini_batches=2",
                "--learner.micro_batch_tokens=64", "--learner.optim.lr=1e-3", *extra]  # fmt: skip
        cfg = load_config("recipes/quickstart_colocated.yaml", args, uses=("learner", "roller", "env"))
        groups = make_groups(4, seed=5, max_len=40)
        r = ColocatedRank(cfg)
        try:
            colocated = [r.train(groups[2 * i : 2 * i + 2]) for i in range(2)]
            colocated_weights = full_state_dict(r.learner.model)
        finally:
            r.close()
        learner = build_learner(cfg.learner, Path(out_dir) / name / "decoupled")
        recorder = Recorder()
        source = ListSource(make_groups(4, seed=5, max_len=40)) if rank == 0 else None
        run(learner, source, max_staleness=0, metrics=recorder if rank == 0 else None)
        weights = full_state_dict(learner.model)
        if rank == 0:
            worst = max(
                float((colocated_weights[k] - w).abs().max() / w.abs().max().clamp_min(1e-12))
                for k, w in weights.items()
            )
            moved = sum(int(not torch.equal(w, colocated_weights[k])) for k, w in weights.items())
            results[name] = {
                "colocated": [{k: m[k] for k in KEYS if k in m} for m in colocated],
                "decoupled": [{k: m[k] for k in KEYS if k in m} for m in recorder.rows],
                "weights_rel": worst,
                "tensors_differing": moved,
                "versions": [r.learner.version, learner.version],
            }
    if rank == 0:
        Path(out_dir, "parity.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def test_colocated_step_equals_decoupled_step(tiny_model: Path, tmp_path: Path) -> None:
    from agentrl.hybrid.procs import run_ranks

    run_ranks(_worker, 2, (str(tiny_model), str(tmp_path)), 400, "the colocated vs decoupled step test")
    results = json.loads((tmp_path / "parity.json").read_text())
    assert results.keys() == VARIANTS.keys()
    for name, r in results.items():
        assert r["versions"] == [2, 2], name
        assert len(r["colocated"]) == len(r["decoupled"]) == 2, name
        for a, b in zip(r["colocated"], r["decoupled"], strict=True):
            assert a.keys() == b.keys(), name
            assert a["grad_norm"] > 1e-4 and abs(a["loss"]) > 1e-8, (name, a)  # something trained
            for key in a:
                assert abs(a[key] - b[key]) <= 1e-6 * max(abs(b[key]), 1e-6), (name, key, a, b)
        if name == "kl":
            assert all(m["kl_ref"] > 0 for m in r["colocated"][1:]), r  # the reference is consulted
        if name == "gae":
            assert all(abs(m["critic/value_loss"]) > 0 for m in r["colocated"]), r
        assert r["weights_rel"] < 1e-6, (name, r["weights_rel"])
