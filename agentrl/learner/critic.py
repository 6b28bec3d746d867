"""The PPO critic: a value head on the policy's architecture, FSDP2-sharded like the actor, with
its own AdamW and learning rate.

    critic = build_critic(model_path, device, lr=1e-5)
    values = critic_values(critic.model, mb)          # flat [rows·T], aligned like mb.adv
    metrics = critic_step(critic, mbs, world_size, clip=0.2, max_grad_norm=1.0)

The model is Hugging Face's `AutoModelForTokenClassification` with one label, loaded from the
policy's checkpoint: the decoder is the checkpoint's, the `score` head (hidden → 1) is new and
zero-initialised, so every value starts at 0 (no random offset to unlearn). Position p of a packed
micro-batch has seen tokens ≤ p, so its output is V(state before token p+1): the same alignment
as the actor's per-position log-prob, advantage and mask (`packing.py`).

`critic_step` minimises PPO's clipped value loss (`gae.value_loss`) against
`mb.extra["returns"]` with `mb.extra["old_values"]` (the values before this update) as the clip
centre, weighted by each micro-batch's aggregation weights, as the actor's loss is.

Not wired into the loop yet: `learner.loss.advantage` has no `gae` choice, the critic is neither
checkpointed nor exported, and the packed micro-batches carry no token rewards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from agentrl.learner import fsdp
from agentrl.learner.gae import explained_variance, value_loss
from agentrl.learner.packing import MicroBatch


@dataclass
class Critic:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def load_value_model(path: str | Path, device: torch.device) -> nn.Module:
    """The checkpoint's decoder with a zero-initialised scalar head, in fp32."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were newly initialised": the head, on purpose
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, dtype=torch.float32, attn_implementation="sdpa"
        )
    finally:
        hf_logging.set_verbosity(level)
    model.config.use_cache = False
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    return model.to(device)


def build_critic(
    model_path: str | Path,
    device: torch.device,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    bf16: bool = False,
) -> Critic:
    """Value model sharded with the actor's FSDP2 layout, and its own AdamW (fused, as the actor's)."""
    model = fsdp.shard_model(load_value_model(model_path, device), device, bf16)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=True
    )
    return Critic(model, optimizer)


def critic_values(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """V at every position of the micro-batch, flat [rows·T], in fp32."""
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)
    return out.logits.reshape(-1).float()


@torch.no_grad()
def store_old_values(model: nn.Module, mbs: list[MicroBatch]) -> None:
    """`mb.extra["old_values"]`: the critic's values before the update (eval mode), for GAE and the clip."""
    was_training = model.training
    model.eval()
    try:
        for mb in mbs:
            mb.extra["old_values"] = critic_values(model, mb)
    finally:
        model.train(was_training)


def critic_step(
    critic: Critic, mbs: list[MicroBatch], world_size: int, clip: float | None, max_grad_norm: float
) -> dict[str, float]:
    """One AdamW step of the critic over this rank's micro-batches; skipped when non-finite.
    Metrics are this rank's; explained variance is that of the values before the step."""
    critic.optimizer.zero_grad(set_to_none=True)
    total, clipped, tokens = 0.0, 0.0, 0.0
    preds, targets = [], []
    for mb in mbs:
        values = critic_values(critic.model, mb)
        per_token, was_clipped = value_loss(values, mb.extra["old_values"], mb.extra["returns"], clip)
        loss = (per_token * mb.mask * mb.weight).sum()
        (loss * world_size).backward()  # FSDP averages gradients over ranks
        m = mb.mask.bool()
        total += float(loss.detach())
        clipped += float(was_clipped[m].sum())
        tokens += float(m.sum())
        preds.append(mb.extra["old_values"][m].cpu().numpy())
        targets.append(mb.extra["returns"][m].cpu().numpy())
    norm = torch.nn.utils.clip_grad_norm_(critic.model.parameters(), max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    finite = math.isfinite(norm) and math.isfinite(total)
    if finite:
        critic.optimizer.step()
    critic.optimizer.zero_grad(set_to_none=True)
    pred, target = (np.concatenate(x) if x else np.zeros(0) for x in (preds, targets))
    return {
        "critic/value_loss": total,
        "critic/clipfrac": clipped / max(tokens, 1.0),
        "critic/grad_norm": norm,
        "critic/explained_variance": explained_variance(pred, target) if pred.size else float("nan"),
        "critic/step_skipped": 0.0 if finite else 1.0,
    }
