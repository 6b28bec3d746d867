"""The weight-sync config section (`weight_sync:`): one model per engine, chosen by `type`.

Kept beside the engines; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it. Imports nothing of the engines themselves.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from agentrl.section import Section


class BroadcastSyncConfig(Section):
    """Bucketed broadcast over a dedicated process group (NCCL on GPUs, gloo on CPU)."""

    type: Literal["broadcast"] = "broadcast"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend; auto picks nccl on CUDA, gloo otherwise."""
    bucket_mb: float = Field(256, gt=0)
    """Size of one broadcast bucket in MiB; peak extra memory on the learner is about three buckets
    (the packing buffers; none on one FSDP2 rank, which lays its weights out in the buckets)."""
    master_address: str = "127.0.0.1"
    """Address of learner rank 0 as the inference servers reach it."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the weight-sync rendezvous; 0 picks a free one."""
    timeout_s: float = Field(120.0, gt=0)
    """Timeout of group set-up and of every collective."""
    workers_per_server: int = Field(1, ge=1)
    """Ranks each inference server contributes to the group (its tensor-parallel size; 1 for embedded)."""
    transactional: Literal["all", "any"] = "any"
    """`any`: each server commits the version or is dropped from the push (re-synced later);
    `all`: every live server commits it or, once one refuses it twice, none does (all stay on the
    previous version). Holds for servers that stage updates (embedded, vLLM); an SGLang server
    loads buckets as they arrive and is kept paused after an aborted push until re-synced."""
    lora_mode: Literal["adapter", "merged"] = "adapter"
    """With `learner.lora`: `adapter` pushes only the adapter's tensors (servers apply it on the
    base they hold); `merged` pushes base + adapter merged as full weights (servers without LoRA)."""


class DiskSyncConfig(Section):
    """Fallback: safetensors in a shared directory plus `/update_weights_from_disk`."""

    type: Literal["disk"] = "disk"
    directory: str | None = None
    """Shared directory the learner writes to (defaults to `<run_dir>/weights`)."""
    keep_last: int = Field(2, ge=1)
    """Weight versions kept on disk."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of one server's load."""
    lora_mode: Literal["adapter", "merged"] = "adapter"
    """With `learner.lora`: `adapter` pushes only the adapter's tensors (servers apply it on the
    base they hold); `merged` pushes base + adapter merged as full weights (servers without LoRA)."""


WeightSyncConfig = Annotated[BroadcastSyncConfig | DiskSyncConfig, Field(discriminator="type")]
