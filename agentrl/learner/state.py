"""The learner's state, the same for every driver of its step (the decoupled loop, the colocated
ranks, `agentrl bench learner`): the backend, the model parts it runs, and where the run stands."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.config import LearnerConfig
from agentrl.learner.backend import LearnerBackend, ModelPart


@dataclass
class Learner:
    """The loop's state: the backend, the model parts it runs, and where the run stands."""

    cfg: LearnerConfig
    run_dir: Path
    backend: LearnerBackend
    actor: ModelPart
    ref: ModelPart | None
    vocab_size: int
    pad_id: int
    critic: ModelPart | None = None
    version: int = 0
    consumed_groups: int = 0

    @property
    def trained_parts(self) -> list[ModelPart]:
        """What a checkpoint holds."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    @property
    def critic_warming_up(self) -> bool:
        """Within `critic.warmup_steps`: only the critic trains (counted in its applied steps)."""
        if self.critic is None:
            return False
        return self.critic.scheduler.last_epoch < self.cfg.critic.warmup_steps * self.cfg.mini_batches

    @property
    def model(self) -> nn.Module:
        return self.actor.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.actor.optimizer

    @property
    def pack_rows(self) -> int | None:
        """The `row_tokens` this learner packs with (`learner.pack_row_tokens` for its model)."""
        return row_tokens(self.cfg.pack_row_tokens, self.model)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def weights(self) -> Callable[[], Iterable[tuple[str, torch.Tensor]]]:
        """What weight sync pushes: the actor's full tensors under HF names (a collective); for a
        LoRA actor, its adapter (`AdapterWeights`: the engine's `lora_mode` picks the adapter's
        tensors or base + adapter merged)."""
        if self.cfg.lora is None:
            return functools.partial(self.backend.full_tensors, self.actor)
        from agentrl.learner import lora
        from agentrl.weight_sync.base import AdapterSpec, AdapterWeights

        spec = AdapterSpec.of(self.cfg.lora, self.cfg.model_path)
        backend, actor = self.backend, self.actor
        return AdapterWeights(
            adapter=lambda: lora.lora_only(backend.adapter_tensors(actor)),
            merged=functools.partial(backend.merged_tensors, actor),
            spec=spec,
        )


def row_tokens(setting: int | None, model: Any) -> int | None:
    """`learner.pack_row_tokens` for `model`: None (one row per micro-batch) or the row width
    (0: rows as wide as the longest sequence, unless the attention is flash attention's varlen)."""
    if setting is None:
        return None
    if setting == 0:
        attn = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
        return None if attn.startswith("flash") else 1  # 1: every row as wide as the longest sequence
    return setting
