"""Tensor-parallel generation models and the lock-step channel of one engine replica.

A replica is `tg` ranks that decode together: each holds one tensor-parallel shard of the model
(`tp_model`: torch-native TP, `ColwiseParallel` on q/k/v/gate/up and `RowwiseParallel` on o/down,
so every attention and MLP block ends in one all-reduce and every rank sees the full logits).
The replica's rank 0 — the leader — runs the engine's scheduler (`agentrl.inference.engine`); it
broadcasts each change of the running batch over `Lockstep` and the followers replay it
(`Engine.follow()`), so all ranks run the same forward on their shards and the TP collectives
meet. The channel is a gloo group even on GPUs (small pickled messages between decode steps),
while the forward's own collectives run on the TP mesh (NCCL on GPUs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Lockstep:
    """The leader → followers broadcast of one replica (`ranks` are global ranks; the first leads)."""

    def __init__(self, ranks: list[int], group: Any) -> None:
        self.ranks = list(ranks)
        self.group = group
        self.leader = self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader

    def publish(self, op: tuple) -> None:
        dist.broadcast_object_list([op], src=self.leader, group=self.group)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


def replica_groups(world: int, tg: int) -> list[list[int]]:
    """Consecutive blocks of `tg` ranks, one per engine replica."""
    if tg < 1 or world % tg:
        raise ValueError(f"colocated.tg={tg} must divide the world size {world}")
    return [list(range(i, i + tg)) for i in range(0, world, tg)]


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """The Megatron-style plan over a HF Llama/Qwen2-style decoder (module names as in HF)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i, _ in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def empty_model(config: Any, device: torch.device, dtype: torch.dtype, mesh: Any = None) -> nn.Module:
    """The HF causal LM of `config` with uninitialised parameters (no weights read, none random):
    built on the meta device, tensor-parallel over `mesh` when given (each rank allocates only its
    shard), then allocated on `device`. Non-persistent buffers (rotary `inv_freq`) are recomputed
    and tied embeddings tied again. The caller fills the parameters (`Engine.load_weights`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if mesh is not None and mesh.size() > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in model.model.layers:
            heads, kv = layer.self_attn.config.num_attention_heads, layer.self_attn.config.num_key_value_heads
            if heads % mesh.size() or kv % mesh.size():
                raise ValueError(f"tensor parallel {mesh.size()} must divide the heads ({heads}, kv {kv})")
        parallelize_module(model, mesh, tp_plan(model))
    model.to_empty(device=device)
    for name, module in model.named_modules():
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"{name} ({type(module).__name__}) has computed buffers that cannot be rebuilt")
        with torch.device(device):
            fresh = type(module)(module.config)
        for buf in module._non_persistent_buffers_set:
            getattr(module, buf).copy_(getattr(fresh, buf))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
