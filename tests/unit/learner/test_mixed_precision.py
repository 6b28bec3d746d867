"""bf16 mixed precision (FSDP2 `MixedPrecisionPolicy`) on CPU with gloo, as `learner.dtype=bfloat16`.

The master weights, gradients and AdamW state stay fp32 while the forward computes in bf16;
the learner's log-softmax runs in fp32 on the bf16 logits; one bf16 step agrees with the fp32
step to bf16 accuracy; and a 2-rank bf16 run (torchrun, gloo) makes the same update as a
1-rank bf16 run. Weight sync, called after the update, gathers the fp32 masters (a no-grad
bf16 forward alone would leave the root's bf16 compute copies registered). AdamW's first step
moves each weight by about ±lr (the sign of its gradient), so updated weights are compared by
the sign of their update and by |Δ| ≤ 2·lr, and gradients by their relative error.

This file is also the torchrun worker: `torchrun ... test_mixed_precision.py OUT_DIR MODEL_PATH`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from agentrl.learner.data import prepare_batch
from agentrl.learner.fsdp import full_state_dict, iter_full_tensors
from agentrl.learner.hf_model import forward_logprobs
from agentrl.learner.loop import build_learner, run
from agentrl.learner.packing import plan_microbatches
from agentrl.learner.train_step import microbatch_loss
from agentrl.log import MetricsLogger, read_metrics
from tests.conftest import end_rank, run_torchrun
from tests.unit.learner.source import ListSource, learner_config, make_groups

LR = 1e-3


def _cfg(model_path, dtype: str, **kw):
    base = dict(model_path=str(model_path), groups_per_step=2, max_steps=1, micro_batch_tokens=64, lr=LR,
                batch_timeout_s=0.1, dtype=dtype)  # fmt: skip
    return learner_config(**{**base, **kw})


def _plan(learner, groups):
    cfg = learner.cfg
    batch = prepare_batch(groups, advantage=cfg.loss.advantage, loss_agg=cfg.loss.loss_agg, vocab_size=learner.vocab_size,
                          learner_version=learner.version, mini_batches=1, max_seq_tokens=cfg.max_seq_tokens)  # fmt: skip
    return plan_microbatches(
        batch.mini_batches[0], cfg.micro_batch_tokens, 1, 0, cfg.pad_multiple, learner.pad_id
    )


def _grads(learner, groups) -> dict[str, torch.Tensor]:
    """The gradient of the learner's objective on `groups` (fp32, full tensors); grads cleared after."""
    for mb in _plan(learner, groups):
        logp, ent = forward_logprobs(learner.model, mb)
        loss, _, _ = microbatch_loss(logp, ent, mb, learner.cfg.loss, learner.version)
        loss.backward()
    grads = {}
    for name, param in learner.model.named_parameters():
        assert param.grad.dtype == torch.float32, name  # reduce_dtype / master gradients
        grads[name] = param.grad.full_tensor().clone()
    learner.optimizer.zero_grad(set_to_none=True)
    return grads


def _one_step(tiny_model, tmp_path, dtype, groups):
    """(learner, weights before, weights after, grads, logged metrics, dtypes seen by a layer's forward)."""
    learner = build_learner(_cfg(tiny_model, dtype), tmp_path / dtype)
    seen: list[torch.dtype] = []
    learner.model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    before = {k: v.clone() for k, v in full_state_dict(learner.model).items()}
    grads = _grads(learner, groups)
    metrics = MetricsLogger(tmp_path / dtype)
    run(learner, ListSource(groups), max_staleness=1, metrics=metrics)
    metrics.close()
    after = {k: v.clone() for k, v in full_state_dict(learner.model).items()}
    return learner, before, after, grads, read_metrics(tmp_path / dtype / "metrics.jsonl")[-1], seen


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _compare_updates(got: dict, expected: dict, initial: dict) -> None:
    """bf16-level agreement of two one-step AdamW updates from the same initial weights."""
    d_got = torch.cat([(got[k] - initial[k]).flatten() for k in initial])
    d_exp = torch.cat([(expected[k] - initial[k]).flatten() for k in initial])
    assert torch.isfinite(d_got).all()
    assert d_exp.abs().max() > 0.5 * LR  # the step really moved the weights
    assert (d_got - d_exp).abs().max() <= 2 * LR * 1.01  # at worst an opposite-sign ±lr step
    moved = d_exp.abs() > 0.1 * LR
    agree = float((d_got.sign() == d_exp.sign())[moved].float().mean())
    assert agree > 0.98, agree  # measured 0.998 (bf16 vs fp32): only near-zero gradients flip
    assert _rel(d_got, d_exp) < 0.25  # measured 0.08


def test_bf16_keeps_fp32_master_weights_and_optimizer_state_and_computes_in_bf16(tiny_model, tmp_path):
    groups = make_groups(2, seed=4)
    learner, *_, seen = _one_step(tiny_model, tmp_path, "bfloat16", groups)
    assert seen and set(seen) == {torch.bfloat16}  # every forward (recompute, train) ran in bf16
    for name, param in learner.model.named_parameters():
        assert type(param).__name__ == "DTensor" and param.dtype == torch.float32, name
    state = learner.optimizer.state_dict()["state"]
    assert state and all(
        s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 and int(s["step"]) == 1
        for s in state.values()
    )
    _, *_, seen32 = _one_step(tiny_model, tmp_path, "float32", groups)
    assert set(seen32) == {torch.float32}  # the control: fp32 stays fp32


def test_bf16_step_agrees_with_fp32_step(tiny_model, tmp_path):
    groups = make_groups(2, seed=4)
    _, init32, after32, grads32, m32, _ = _one_step(tiny_model, tmp_path, "float32", groups)
    _, init16, after16, grads16, m16, _ = _one_step(tiny_model, tmp_path, "bfloat16", groups)
    for name in init32:
        torch.testing.assert_close(init16[name], init32[name], rtol=0, atol=0)  # fp32 masters, same start
        assert after16[name].dtype == torch.float32, name
    g32 = torch.cat([g.flatten() for g in grads32.values()])
    g16 = torch.cat([g.flatten() for g in grads16.values()])
    assert torch.isfinite(g16).all()
    assert 1e-4 < _rel(g16, g32) < 3e-2  # measured 0.007; exactly equal would mean no bf16 compute
    for name in grads32:
        assert _rel(grads16[name], grads32[name]) < 0.1, name
    assert m16["step_skipped"] == 0 and m32["step_skipped"] == 0
    assert m16["loss"] == pytest.approx(m32["loss"], rel=1e-2)  # measured 7e-4
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)  # measured 1.3e-3
    _compare_updates(after16, after32, init32)


def test_logprobs_take_fp32_log_softmax_of_bf16_logits(tiny_model, tmp_path):
    learner = build_learner(_cfg(tiny_model, "bfloat16"), tmp_path)
    logits: list[torch.Tensor] = []
    learner.model.register_forward_hook(lambda mod, args, out: logits.append(out.logits.detach()))
    mb = _plan(learner, make_groups(1, seed=2))[0]
    with torch.no_grad():
        logp, _ = forward_logprobs(learner.model, mb)
    assert logits[0].dtype == torch.bfloat16 and logp.dtype == torch.float32
    flat = logits[0].reshape(-1, logits[0].shape[-1])
    where = mb.mask.nonzero().squeeze(-1)
    targets = mb.targets[where].unsqueeze(-1)
    fp32 = torch.log_softmax(flat[where].float(), -1).gather(-1, targets).squeeze(-1)
    bf16 = torch.log_softmax(flat[where], -1).gather(-1, targets).squeeze(-1).float()
    torch.testing.assert_close(logp[where], fp32, rtol=1e-5, atol=1e-5)
    assert (logp[where] - bf16).abs().max() > 1e-3  # a bf16 log-softmax would be visibly coarser
    assert torch.equal(logp[mb.mask == 0], torch.zeros_like(logp[mb.mask == 0]))


class DtypePushes:
    """A weight-sync stand-in at the loop's edge: records the dtypes of the gathered weights."""

    def __init__(self):
        self.dtypes: list[set[torch.dtype]] = []

    def push(self, weights, version):
        self.dtypes.append({t.dtype for _, t in weights()})


def test_weight_sync_gets_fp32_weights_under_bf16(tiny_model, tmp_path):
    # decoupled PPO and a KL reference: no-grad bf16 forwards run before each update
    cfg = _cfg(tiny_model, "bfloat16", max_steps=2, off_policy="decoupled", kl_coef=0.05)
    learner = build_learner(cfg, tmp_path)
    sync = DtypePushes()
    run(learner, ListSource(make_groups(4, seed=5)), max_staleness=2, weight_sync=sync)
    assert sync.dtypes == [{torch.float32}, {torch.float32}]


# -- 2 ranks == 1 rank under bf16 (torchrun, gloo) ------------------------------------------------

MULTI = dict(groups_per_step=3, max_steps=1, micro_batch_tokens=48, off_policy="decoupled", kl_coef=0.05,
             loss_agg="seq_mean_token_mean", advantage="rloo")  # fmt: skip


def worker(out_dir: str, model_path: str) -> None:
    learner = build_learner(_cfg(model_path, "bfloat16", **MULTI), out_dir)
    seen: list[torch.dtype] = []
    learner.model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    source = ListSource(make_groups(3, seed=11, max_len=60)) if learner.rank == 0 else None
    metrics = MetricsLogger(out_dir) if learner.rank == 0 else None
    run(learner, source, max_staleness=4, metrics=metrics)
    state = full_state_dict(learner.model)
    if learner.rank == 0:
        metrics.close()
        torch.save(state, Path(out_dir) / "weights.pt")
        result = {"world": learner.world_size, "dtypes": sorted({str(d) for d in seen})}
        (Path(out_dir) / "result.json").write_text(json.dumps(result))
    end_rank()


def _torchrun(nproc: int, out: Path, model: Path) -> dict:
    run_torchrun(__file__, nproc, str(out), str(model))
    result = json.loads((out / "result.json").read_text())
    assert result == {"world": nproc, "dtypes": ["torch.bfloat16"]}
    return read_metrics(out / "metrics.jsonl")[-1]


@pytest.mark.slow
def test_two_rank_bf16_update_equals_one_rank(tiny_model, tmp_path):
    from safetensors.torch import load_file

    m1 = _torchrun(1, tmp_path / "one", tiny_model)
    m2 = _torchrun(2, tmp_path / "two", tiny_model)
    one = torch.load(tmp_path / "one" / "weights.pt")
    two = torch.load(tmp_path / "two" / "weights.pt")
    initial = load_file(tiny_model / "model.safetensors")
    assert one.keys() == two.keys()
    assert all(one[k].dtype == two[k].dtype == torch.float32 for k in one)
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-2)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=2e-2)
    shared = {k: v for k, v in initial.items() if k in one}
    assert len(shared) > 10
    _compare_updates(two, one, shared)


def test_full_tensors_are_fp32_even_right_after_a_no_grad_forward(tiny_model, tmp_path):
    """Units kept gathered after a forward expose their bf16 compute copies as parameters;
    the weights handed to weight sync and export must still be the fp32 masters."""
    learner = build_learner(_cfg(tiny_model, "bfloat16"), tmp_path)
    with torch.no_grad():
        for mb in _plan(learner, make_groups(1, seed=5)):
            forward_logprobs(learner.model, mb)
    assert {t.dtype for _, t in iter_full_tensors(learner.model)} == {torch.float32}
    with torch.no_grad():
        for mb in _plan(learner, make_groups(1, seed=6)):
            forward_logprobs(learner.model, mb)
    assert {t.dtype for t in full_state_dict(learner.model).values()} == {torch.float32}


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
