"""PPO's critic: a value head on the policy's architecture, built, run and stepped through the
learner backend (distributed like the actor: FSDP2 shards, or Megatron TP / PP), with its own AdamW and learning rate.

    critic = build_critic(backend, cfg)                     # `loss.advantage: gae`
    adv_metrics = gae_advantages(backend, critic, plans, cfg.loss)   # before any update
    metrics = critic_step(backend, critic, plan, cfg.critic)         # per mini-batch

The model (the backend builds it: `backend.build("value", ...)`; for HF models
`hf_model.load_value_model`) is Hugging Face's `AutoModelForTokenClassification` with one label,
loaded from the policy's checkpoint (or `critic.model_path`): the decoder is the checkpoint's, the `score` head
(hidden → 1) is new and zero-initialised, so every value starts at 0 (no random offset to
unlearn); a checkpoint that already is a one-label token classifier (an exported critic) keeps
its head. Position p of a packed micro-batch has seen tokens ≤ p, so its output is V(state
before token p+1): the same alignment as the actor's per-position log-prob, advantage, mask and
token reward (`packing.py`).

`gae_advantages` runs the critic without gradients over the packed micro-batches (its values
before this step's update are `mb.extra["old_values"]`), then GAE(γ, λ) per packed sequence
(`gae.gae`: tool tokens are not actions, the value bootstraps across them), writes the
advantages into `mb.adv` and the returns into `mb.extra["returns"]`, and whitens the advantages
over every action token of the batch on all ranks (TRL's `masked_whiten`).

`critic_step` minimises PPO's clipped value loss (`gae.value_loss`) against the returns with
the old values as the clip centre, weighted by each micro-batch's aggregation weights, as the
actor's loss is. Its metrics (value loss, clip fraction, explained variance of the old values)
are sums over all ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from agentrl.config import CriticConfig, LearnerConfig, LossConfig
from agentrl.learner.backend import LearnerBackend, ModelPart
from agentrl.learner.gae import gae, value_loss
from agentrl.learner.packing import MicroBatch


def build_critic(backend: LearnerBackend, cfg: LearnerConfig) -> ModelPart:
    """The critic part: `critic.model_path` (default: the policy's), sharded like the actor, with
    its own AdamW at a constant learning rate (`critic.optim`)."""
    path = cfg.critic.model_path or cfg.model_path
    return backend.build("value", path, name="critic", optim=cfg.critic.optim, bf16=cfg.dtype == "bfloat16")


def gae_advantages(
    backend: LearnerBackend, critic: ModelPart, plans: list[list[MicroBatch]], loss: LossConfig
) -> dict[str, float]:
    """Old values, GAE advantages and returns on every micro-batch of the step (see the module
    docstring); returns the advantage and value statistics over the batch (all ranks)."""
    mbs = [mb for plan in plans for mb in plan]
    with backend.frozen(critic):
        for mb in mbs:
            mb.extra["old_values"] = backend.values(critic, mb).detach()
    for mb in mbs:
        adv, ret = _packed_gae(mb, loss.gamma, loss.lam)
        mb.adv = adv
        mb.extra["returns"] = ret
    stats = {"n": 0.0, "sum": 0.0, "sumsq": 0.0, "v_sum": 0.0, "r_sum": 0.0}
    for mb in mbs:
        a = mb.adv[mb.mask.bool()].double()
        stats["n"] += float(a.numel())
        stats["sum"] += float(a.sum())
        stats["sumsq"] += float((a * a).sum())
        stats["v_sum"] += float(mb.extra["old_values"][mb.mask.bool()].sum())
        stats["r_sum"] += float(mb.extra["returns"][mb.mask.bool()].sum())
    stats = backend.all_reduce(stats, "sum")
    n = max(stats["n"], 1.0)
    mean = stats["sum"] / n
    var = (stats["sumsq"] - n * mean * mean) / max(n - 1, 1.0)  # unbiased, as TRL's masked_var
    std = math.sqrt(max(var, 0.0))
    if loss.whiten_advantages and stats["n"] >= 2:
        scale = 1.0 / math.sqrt(max(var, 0.0) + 1e-8)
        for mb in mbs:
            mb.adv = torch.where(mb.mask.bool(), (mb.adv - mean) * scale, torch.zeros_like(mb.adv))
    return {"adv/gae_mean": mean, "adv/gae_std": std, "critic/values_mean": stats["v_sum"] / n,
            "critic/returns_mean": stats["r_sum"] / n}  # fmt: skip


def _packed_gae(mb: MicroBatch, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each sequence of a packed micro-batch (segments of `mb.seq_idx`)."""
    mask = mb.mask.cpu().numpy()
    values = mb.extra["old_values"].cpu().numpy()
    rewards = mb.rewards.cpu().numpy() if mb.rewards is not None else np.zeros_like(mask)
    seq = mb.seq_idx.cpu().numpy()
    adv, ret = np.zeros(len(mask)), np.zeros(len(mask))
    bounds = np.flatnonzero(np.diff(seq)) + 1
    for start, end in zip(np.r_[0, bounds], np.r_[bounds, len(seq)], strict=True):
        adv[start:end], ret[start:end] = gae(
            rewards[start:end], values[start:end], mask[start:end], gamma, lam
        )
    device = mb.mask.device
    return (torch.from_numpy(adv).float().to(device), torch.from_numpy(ret).float().to(device))


def critic_step(
    backend: LearnerBackend, critic: ModelPart, mbs: list[MicroBatch], cfg: CriticConfig
) -> dict[str, float]:
    """One AdamW step of the critic over this rank's micro-batches; skipped when non-finite."""
    sums = {"loss": 0.0, "clipped": 0.0, "tokens": 0.0, "r": 0.0, "r2": 0.0, "e": 0.0, "e2": 0.0}

    def loss_fn(mb: MicroBatch) -> torch.Tensor:
        values = backend.values(critic, mb)
        old, ret = mb.extra["old_values"], mb.extra["returns"]
        per_token, was_clipped = value_loss(values, old, ret, cfg.value_clip)
        loss = (per_token * mb.mask * mb.weight).sum()
        with torch.no_grad():
            m = mb.mask.bool()
            r, e = ret[m].double(), (ret - old)[m].double()
            sums["loss"] += float(loss.detach())
            sums["clipped"] += float(was_clipped[m].sum())
            sums["tokens"] += float(m.sum())
            sums["r"] += float(r.sum())
            sums["r2"] += float((r * r).sum())
            sums["e"] += float(e.sum())
            sums["e2"] += float((e * e).sum())
        return loss

    backend.forward_backward(critic, mbs, loss_fn)
    lr = critic.lr
    sums = backend.all_reduce(sums, "sum")
    norm, applied = backend.optimizer_step(
        critic, cfg.optim.max_grad_norm, skip=not math.isfinite(sums["loss"])
    )
    n = max(sums["tokens"], 1.0)
    var_r = sums["r2"] / n - (sums["r"] / n) ** 2
    var_e = sums["e2"] / n - (sums["e"] / n) ** 2
    return {
        "critic/value_loss": sums["loss"],
        "critic/clipfrac": sums["clipped"] / n,
        "critic/grad_norm": norm,
        "critic/lr": lr,
        # 1 − Var(R − V_old)/Var(R) over the action tokens (gae.explained_variance, on all ranks)
        "critic/explained_variance": 1.0 - var_e / var_r if var_r > 0 else float("nan"),
        "critic/step_skipped": 0.0 if applied else 1.0,
    }
