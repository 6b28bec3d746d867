"""One learner step: log-probs, the policy objective per micro-batch, backward, clip, step.

The loop runs one `optimizer_step` per mini-batch of a consumed batch (usually one). Before
the first update it recomputes (`recompute_logprobs`), without gradients, whatever the
objective needs from frozen policies: π_old/π_prox (decoupled PPO always; TIS when there are
several mini-batches) and π_ref (KL penalty). Gradients are accumulated over packed
micro-batches; each micro-batch contributes Σ loss·weight, with weights normalised over the
whole mini-batch on all ranks. Models are reached only through the `LearnerBackend`.

A non-finite loss or gradient norm skips the optimizer step (gradients dropped, scheduler
not advanced) and is reported in the metrics, so a NaN never reaches the weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from agentrl.config import LearnerConfig, LossConfig
from agentrl.learner import losses
from agentrl.learner.backend import LearnerBackend, ModelPart
from agentrl.learner.packing import MicroBatch


def recompute_logprobs(
    backend: LearnerBackend, part: ModelPart, mbs: list[MicroBatch], key: str, temperature: float
) -> None:
    """Store a frozen policy's log-probs in `mb.extra[key]` for every micro-batch.

    The forward runs in eval mode (no dropout: the log-probs of the policy itself, not of one
    dropout mask) and the model's mode is restored afterwards (`backend.frozen`)."""
    with backend.frozen(part):
        for mb in mbs:
            mb.extra[key] = backend.logprobs(part, mb, temperature)[0].detach()


def policy_loss(
    logp: torch.Tensor, old: torch.Tensor, mb: MicroBatch, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss of `cfg.policy_loss` and a bool tensor of clipped tokens."""
    if cfg.policy_loss == "gspo":
        return losses.gspo(logp, old, mb.adv, mb.mask, mb.seq_idx, mb.num_seqs, cfg.clip_low, cfg.clip_high,
                           cfg.dual_clip)  # fmt: skip
    if cfg.policy_loss == "cispo":
        return losses.cispo(logp, old, mb.adv, cfg.clip_low, cfg.clip_high)
    if cfg.policy_loss == "sapo":
        return losses.sapo(logp, old, mb.adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return losses.ppo_clip(logp, old, mb.adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)


def off_policy_weight(
    learner_old: torch.Tensor, mb: MicroBatch, cfg: LossConfig
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The detached per-token correction weight of `cfg.off_policy` times the sequence mask (None:
    no weight), and the bool per-token mask `seq_mask` kept (None when it is off)."""
    behav, mode = mb.behav_logp, cfg.off_policy
    w = None
    if mode == "tis":
        w = losses.tis_weight(learner_old, behav, cfg.is_cap)
    elif mode == "decoupled":
        w = losses.masked_is_weight(learner_old, behav, 0.0, cfg.is_cap)
    elif mode == "mis":
        w = losses.masked_is_weight(learner_old, behav, cfg.mis_low, cfg.is_cap)
    elif mode == "icepop":
        w = losses.masked_is_weight(learner_old, behav, cfg.icepop_low, cfg.icepop_high)
    elif mode == "seq_tis":
        w = losses.geometric_seq_ratio(learner_old, behav, mb.mask, mb.seq_idx, mb.num_seqs).clamp(
            max=cfg.is_cap
        )
    if cfg.seq_mask is None:
        return w, None
    g = losses.geometric_seq_ratio(learner_old, behav, mb.mask, mb.seq_idx, mb.num_seqs)
    kept = (g >= cfg.seq_mask[0]) & (g <= cfg.seq_mask[1])
    return (kept.to(g.dtype) if w is None else w * kept), kept


def microbatch_loss(
    logp: torch.Tensor, ent: torch.Tensor | None, mb: MicroBatch, cfg: LossConfig, version: int
) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """The micro-batch's share of the loss, plus metric sums and maxima over its loss tokens."""
    mask = mb.mask
    learner_old = mb.extra.get("old_logp", logp.detach())  # the learner's π before this update
    old = mb.behav_logp if cfg.off_policy == "none" else learner_old
    pg, clipped = policy_loss(logp, old, mb, cfg)
    is_w, seq_kept = off_policy_weight(learner_old, mb, cfg)
    per_token = pg if is_w is None else pg * is_w
    kl = None
    if cfg.kl_coef > 0:
        kl = losses.kl_penalty(logp, mb.extra["ref_logp"], cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    if ent is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    loss = losses.aggregate(per_token, mask, mb.weight)

    with torch.no_grad():
        m = mask.bool()
        # learner vs inference server on the same tokens, whatever the objective uses as π_old
        raw_w = torch.exp((learner_old - mb.behav_logp).clamp(-20, 20))[m]  # before capping
        diff = (mb.behav_logp - learner_old)[m]  # log π_behav − log π_learner, tokens sampled from π_behav
        on_policy = (mb.versions == version)[m]
        seq_has_loss = mask.new_zeros(mb.num_seqs).index_add(0, mb.seq_idx, mask) > 0
        sums = {
            "tokens": float(m.sum()),
            "loss": float(loss),
            "pg_loss": float((pg * mask * mb.weight).sum()),
            "clipfrac": float(clipped[m].sum()),
            "ratio": float(torch.exp((logp.detach() - old).clamp(-20, 20))[m].sum()),
            "is_weight": float(raw_w.sum()),
            "is_capped": float((raw_w > cfg.is_cap).sum()),
            "is_masked": float((is_w[m] == 0).sum()) if is_w is not None else 0.0,
            "seqs": float(seq_has_loss.sum()),
            "seqs_masked": float(_masked_seqs(seq_kept, mb, seq_has_loss)),
            "mismatch_kl_k1": float(diff.sum()),
            "mismatch_kl_k3": float((torch.exp(-diff) + diff - 1).sum()),
            "on_policy_tokens": float(on_policy.sum()),
            "mismatch_kl_k3_on_policy": float((torch.exp(-diff) + diff - 1)[on_policy].sum()),
            "entropy": float(ent[m].nansum()) if ent is not None else 0.0,
            "entropy_tokens": float((~ent[m].isnan()).sum()) if ent is not None else 0.0,
            "kl_ref": float(kl[m].sum()) if kl is not None else 0.0,
        }
        maxes = {"is_weight_max": float(raw_w.max()) if raw_w.numel() else 0.0}
        maxes["is_weight_min_neg"] = float(-raw_w.min()) if raw_w.numel() else 0.0
    return loss, sums, maxes


def mismatch_without_replay(
    backend: LearnerBackend, part: ModelPart, mb: MicroBatch, temperature: float
) -> float:
    """Σ over the loss tokens of the k3 mismatch KL between the behaviour log-probs and the learner's
    log-probs with the model's own routing (no replay), without gradient: the metric router replay
    is judged by."""
    with torch.no_grad():
        own = backend.logprobs(part, dataclasses.replace(mb, routed_experts=None), temperature)[0]
        diff = (mb.behav_logp - own)[mb.mask.bool()]
        return float((torch.exp(-diff) + diff - 1).sum())


def _masked_seqs(kept: torch.Tensor | None, mb: MicroBatch, seq_has_loss: torch.Tensor) -> int:
    """Sequences with loss tokens that the sequence mask dropped."""
    if kept is None:
        return 0
    dropped = mb.mask.new_zeros(mb.num_seqs).index_add(0, mb.seq_idx, mb.mask * (~kept).to(mb.mask.dtype))
    return int(((dropped > 0) & seq_has_loss).sum())


def optimizer_step(
    backend: LearnerBackend, part: ModelPart, mbs: list[MicroBatch], cfg: LearnerConfig, version: int
) -> dict[str, float]:
    """Accumulate gradients over this rank's micro-batches and apply one clipped AdamW step."""
    sums: dict[str, float] = defaultdict(float)
    maxes: dict[str, float] = defaultdict(lambda: -math.inf)
    entropy = "grad" if cfg.loss.entropy_coef > 0 else "metric"
    if cfg.moe.router_replay:
        sums["mismatch_kl_k3_no_replay"] = 0.0  # every rank reduces the same keys

    def loss_fn(mb: MicroBatch) -> torch.Tensor:
        if mb.routed_experts is not None:  # what the mismatch would be without router replay
            sums["mismatch_kl_k3_no_replay"] += mismatch_without_replay(backend, part, mb, cfg.temperature)
        logp, ent = backend.logprobs(part, mb, cfg.temperature, entropy)
        loss, s, mx = microbatch_loss(logp, ent, mb, cfg.loss, version)
        for k, v in s.items():
            sums[k] += v
        for k, v in mx.items():
            maxes[k] = max(maxes[k], v)
        return loss

    backend.forward_backward(part, mbs, loss_fn)
    lr = part.lr
    sums = backend.all_reduce(dict(sums), "sum")
    maxes = backend.all_reduce(dict(maxes), "max")
    grad_norm, finite = backend.optimizer_step(
        part, cfg.optim.max_grad_norm, skip=not math.isfinite(sums["loss"])
    )
    n = max(sums["tokens"], 1.0)
    n_on = max(sums["on_policy_tokens"], 1.0)
    replay = {}
    if cfg.moe.router_replay:  # the mismatch with the routing replayed, and what it would be without
        replay = {
            "moe/mismatch_kl_k3_replay": sums["mismatch_kl_k3"] / n,
            "moe/mismatch_kl_k3_no_replay": sums["mismatch_kl_k3_no_replay"] / n,
        }
    return {
        **replay,
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        "step_skipped": 0.0 if finite else 1.0,
        "clipfrac": sums["clipfrac"] / n,
        "ratio_mean": sums["ratio"] / n,
        "is_weight/mean": sums["is_weight"] / n,
        "is_weight/max": maxes["is_weight_max"],
        "is_weight/min": -maxes["is_weight_min_neg"],
        "is_weight/capped_frac": sums["is_capped"] / n,
        "is_weight/masked_frac": sums["is_masked"] / n,
        "is_weight/seq_masked_frac": sums["seqs_masked"] / max(sums["seqs"], 1.0),
        "mismatch_kl/k1": sums["mismatch_kl_k1"] / n,
        "mismatch_kl/k3": sums["mismatch_kl_k3"] / n,
        "mismatch_kl/k3_on_policy": sums["mismatch_kl_k3_on_policy"] / n_on,
        "entropy": sums["entropy"] / max(sums["entropy_tokens"], 1.0),
        "kl_ref": sums["kl_ref"] / n,
        "loss_tokens": sums["tokens"],
    }
