"""The learner-backend seam: what the loop needs from a training framework, and nothing else.

The loop (`loop.py`) and the step (`train_step.py`) hold the algorithm: which forwards run, the
losses, when to step, what to log. A backend holds the framework: how models are built, sharded,
run, stepped, gathered, saved and exported. FSDP2 (`fsdp.FSDP2Backend`) and Megatron-core
(`megatron.MegatronBackend`, whose `forward_backward` runs Megatron's own pipeline schedule around
the same `loss_fn`) fill it; `registry.create` picks one by name (this module imports neither). The shape follows torchtitan's `TrainSpec` (build
functions per role; torchtitan/protocols/train_spec.py) and slime's per-framework actors
(slime/backends/fsdp_utils, slime/backends/megatron_utils).

    backend = registry.create(cfg.backend, cfg.megatron)    # picks by `learner.backend`
    actor = backend.build("policy", cfg.model_path, optim=cfg.optim, lr_lambda=...)
    ref = backend.build("policy", cfg.model_path)           # frozen: no optimizer
    with backend.frozen(ref):
        logp, _ = backend.logprobs(ref, mb, temperature)
    backend.forward_backward(actor, mbs, loss_fn)           # loss_fn(mb) -> scalar loss
    grad_norm, applied = backend.optimizer_step(actor, max_grad_norm, skip=not finite)
    weight_sync.push(functools.partial(backend.full_tensors, actor), version)

Every method that communicates is a collective: every rank calls it, in the same order.
`local_shards` is for a colocated inference engine that reads the training shards in place
(each parameter's local piece and how it is laid out across the mesh), without a full gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from agentrl.learner.packing import MicroBatch

PartKind = Literal["policy", "value"]
"""`policy`: a causal LM (log-probs of target tokens); `value`: the same architecture with a
scalar head (one value per position), as PPO's critic."""


@dataclass
class ModelPart:
    """One model the learner trains or consults (actor, reference, critic): the backend's module,
    and its optimizer and LR schedule when it is trained (None for a frozen part)."""

    name: str
    kind: PartKind
    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0


class NonFiniteError(RuntimeError):
    """The weights, or the optimizer state a step would read, hold a NaN or an infinity; the
    message names the tensor. Raised before anything non-finite is pushed or saved."""


@dataclass
class LocalShard:
    """This rank's piece of one parameter, in place (no copy): `local` is the local tensor,
    `placements` how the full tensor is laid out over `mesh` (torch DTensor `Shard(0)` /
    `Replicate()`), `global_shape` the full tensor's shape. A parameter that is not distributed
    has `placements=()` and `mesh=None`, and `local` is the whole tensor."""

    name: str
    local: torch.Tensor
    placements: tuple[Any, ...]
    mesh: Any
    global_shape: torch.Size


class LearnerBackend(Protocol):
    """The training framework behind the learner (see the module docstring)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    """The data-parallel index and size: the ranks that see different data (each packs its own
    micro-batches). `rank` and `world_size` unless the model is also tensor parallel (the `t`
    ranks of a TP group run the same micro-batches; hybrid/backend.py)."""
    device: torch.device

    def build(
        self,
        kind: PartKind,
        path: str | Path,
        *,
        name: str = "actor",
        optim: Any = None,
        lr_lambda: Callable[[int], float] | None = None,
        activation_checkpointing: bool = False,
        bf16: bool = False,
        shard: Callable[[nn.Module], nn.Module] | None = None,
        lora: Any = None,
        push_buckets: int | None = None,
    ) -> ModelPart:
        """Load a model of `kind` from the HF checkpoint at `path` and distribute it. With
        `optim` (an `OptimConfig`: lr, betas, weight decay) it is trained by AdamW under the LR
        schedule `lr_lambda`; without, it is frozen (eval mode, no gradients). `shard`, when given,
        distributes the loaded module instead of the backend's default layout (the colocated
        HybridEngine's placement). `lora` (a `learner.lora.LoraConfig`, policies only) wraps it with
        LoRA adapters first: only their parameters train (a backend without LoRA refuses it).
        `push_buckets` (bytes: the broadcast weight push's bucket size, when the model is pushed
        that way) lets a backend lay the weights out in the push's buckets so that a push sends
        them without packing (FSDP2 on one rank does; the others ignore it)."""
        ...

    def logprobs(
        self, part: ModelPart, mb: MicroBatch, temperature: float = 1.0, entropy: str = "none"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A policy's log-prob of each target token (flat [rows·T], 0 off the loss mask) and its
        entropy ("grad", "metric" or "none"; see `hf_model.forward_logprobs`)."""
        ...

    def values(self, part: ModelPart, mb: MicroBatch) -> torch.Tensor:
        """A value model's V at every position (flat [rows·T], fp32), aligned like `mb.adv`."""
        ...

    def frozen(self, part: ModelPart) -> contextlib.AbstractContextManager[None]:
        """A context for forwards without gradients and without dropout; the mode is restored after."""
        ...

    def forward_backward(
        self, part: ModelPart, mbs: list[MicroBatch], loss_fn: Callable[[MicroBatch], torch.Tensor]
    ) -> None:
        """Zero the gradients, then for each micro-batch call `loss_fn(mb)` (which runs the
        part's forward) and backpropagate its loss; gradients are the data-parallel sum of the
        per-rank losses (each rank's loss is already normalised over the whole batch)."""
        ...

    def optimizer_step(self, part: ModelPart, max_grad_norm: float, skip: bool = False) -> tuple[float, bool]:
        """Clip gradients to `max_grad_norm` and step the optimizer and LR schedule, unless
        `skip` or the norm is non-finite; gradients are dropped either way. (norm, applied).
        Raises `NonFiniteError` naming the tensor when the optimizer state the step would read is
        not finite (the step is not taken: the weights stay as they were) or the weights it wrote
        are not (they must not be pushed or saved)."""
        ...

    def first_nonfinite(self, part: ModelPart, params: bool = True, state: bool = True) -> str | None:
        """The name of the first of `part`'s parameters (`params`) or optimizer-state tensors
        (`state`) holding a NaN or an infinity, else None. A collective: every rank gets the same
        answer."""
        ...

    def all_reduce(self, values: dict[str, float], op: Literal["sum", "max"]) -> dict[str, float]:
        """The metric dict summed / maxed over the data-parallel ranks."""
        ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the batch the loop trains on)."""
        ...

    def full_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter, one at a time: what weight sync and export
        consume. A collective; every rank iterates to the end."""
        ...

    def adapter_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA actor's adapter, whole, under PEFT's saved names (`base_model.model.<module>.
        lora_A.weight`; with `lora.modules_to_save`, those modules' tensors too): what an adapter
        push and a PEFT export carry. A collective; every rank iterates to the end."""
        ...

    def merged_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA actor's base + adapter merged, as `full_tensors` of the plain model would give
        them (for servers without adapters, and `lora.export_merged`). A collective."""
        ...

    def adapter_disabled(self, part: ModelPart) -> ModelPart:
        """The KL reference of a LoRA actor: the same model run with its adapter disabled (no
        second copy of the base)."""
        ...

    def local_shards(self, part: ModelPart) -> Iterator[LocalShard]:
        """This rank's shard of every parameter with its placement, in place (no communication)."""
        ...

    def save(self, parts: list[ModelPart], path: Path) -> None:
        """Write the parts' weights and optimizer states under `path` (each rank its shards)."""
        ...

    def load(self, parts: list[ModelPart], path: Path) -> None:
        """Restore what `save` wrote into already built parts (resharding to this world size)."""
        ...

    def export(self, part: ModelPart, out_dir: Path, tokenizer_path: str | Path | None) -> Path:
        """A plain HF checkpoint of `part` (safetensors, config, tokenizer) that servers load."""
        ...
