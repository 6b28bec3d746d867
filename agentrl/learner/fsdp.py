"""The FSDP2 learner backend (`FSDP2Backend`, the first filling of `backend.LearnerBackend`):
process group, model loading and sharding, forwards, steps, gathering, DCP save/load, HF export.

The learner's model is a Hugging Face causal LM loaded with `from_pretrained` and sharded with
FSDP2: `fully_shard` on every decoder layer (the classes HF lists in `_no_split_modules`) and
then on the root, so each layer's parameters are all-gathered just before it runs and freed
after. Parameter names are untouched by FSDP2, so `named_parameters()` gives HF names, which
the weight-sync engine and the HF export rely on.

One process without torchrun still gets a (world size 1, gloo) process group, so the same
code path runs everywhere; torchrun's env:// variables select the multi-rank group (NCCL on
GPUs, gloo on CPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from agentrl.learner import hf_model
from agentrl.learner.backend import LocalShard, ModelPart, NonFiniteError, PartKind
from agentrl.learner.packing import MicroBatch
from agentrl.learner.sharded import full, in_place, reshard_units
from agentrl.log import get_logger
from agentrl.weight_sync.base import Resident

log = get_logger("learner.fsdp")


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises the default process group if needed. The device is
    what the launcher gave this rank (`agentrl.launch.devices.local_device`: the Ray launcher's
    `AGENTRL_DEVICE`, else torchrun's `LOCAL_RANK`); a rank told to use a GPU it cannot see
    raises instead of falling back to the CPU."""
    from agentrl.launch.devices import local_device

    name, why = local_device(os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    log.info("rank %d of %d on %s (%s), %s", rank, world, device, why, dist.get_backend())
    return rank, world, device


def load_model(path: str | Path, device: torch.device) -> nn.Module:
    """The HF causal LM in fp32 (FSDP2 keeps fp32 master weights; compute dtype is the MP policy's)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names HF marks as not-to-be-split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (_no_split_modules={names})")
    return layers


def shard_model(
    model: nn.Module, device: torch.device, bf16: bool = False, activation_checkpointing: bool = False
) -> nn.Module:
    """Apply FSDP2 per decoder layer and on the root; optional bf16 compute and recomputation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        # HF's own per-layer checkpointing (non-reentrant) keeps parameter names unchanged.
        if hasattr(model, "activation_checkpointing_enable"):  # the transformers 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = None
    if bf16:
        # FSDP2 keeps fp32 master weights (and so fp32 AdamW state), casts them to bf16 when it
        # gathers a unit for compute, and reduces gradients in fp32. CPUs compute in bf16 too
        # (natively with AVX512-BF16/AMX, emulated otherwise), and gloo carries the bf16
        # all-gathers, so the same policy runs on CPU (tests/unit/learner/test_mixed_precision.py).
        if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            log.warning(
                "learner.dtype=bfloat16: %s has no bf16 mixed precision here; training in fp32", device
            )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    # One FSDP unit per decoder layer, gathered just before it runs (and, with several ranks,
    # freed after). One rank has nothing to free. The root's parameters are needed first thing
    # in backward, so it keeps them either way (as torchtitan does). A root-only unit for one
    # rank was tried: 7% faster per step on the 0.2M model, 8% slower on the 13M one.
    reshard = dist.get_world_size() > 1
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def home_for_push(model: nn.Module, bucket_bytes: int) -> int:
    """One rank (every parameter whole on it): lay the parameters out in the weight push's buckets,
    one flat buffer per bucket, each tensor where the broadcast engine's packing would put it (the
    buckets `weight_sync.buckets.iter_buckets` cuts at `bucket_bytes`, in `named_parameters()`
    order, as `iter_full_tensors` yields them), so a push sends every bucket as it lies, without
    copying the model into packing buffers first (`Packer.pack` finds the tensors back to back).

    Goes through `load_state_dict(assign=True)`, which FSDP2 follows (its post-load hook points
    each sharded parameter's data at the new tensor): the parameters are new objects, so call it
    before the optimizer is built. Tied parameters stay one parameter. A bucket that cannot travel
    flat (`buckets.flat_layout`: one tensor, or one at an offset its dtype does not divide) is left
    as it is: it is sent without packing anyway. Returns the buckets laid out."""
    from torch.distributed.tensor import DTensor

    from agentrl.inference.weight_group import unflatten
    from agentrl.weight_sync.buckets import flat_layout, iter_buckets

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("home_for_push: the parameters are sharded over several ranks")
    named = list(model.named_parameters())  # tied parameters once, as the push reads them
    params = dict(named)
    local = [(name, p.detach().to_local() if isinstance(p, DTensor) else p.detach()) for name, p in named]
    homed: dict[int, nn.Parameter] = {}
    laid = 0
    with torch.no_grad():
        for bucket in iter_buckets(local, bucket_bytes):
            if not flat_layout(bucket.tensors):  # it travels as it is, or tensor by tensor
                continue
            # packed as the engine packs a bucket, then each parameter a view of it, as a server
            # unflattens one
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket.tensors])
            specs = [(name, t.dtype, t.shape) for name, t in zip(bucket.names, bucket.tensors, strict=True)]
            for name, view in unflatten(flat, specs).items():
                old = params[name]
                if isinstance(old, DTensor):
                    view = DTensor.from_local(view, old.device_mesh, old.placements, run_check=False,
                                              shape=old.shape, stride=old.stride())  # fmt: skip
                homed[id(old)] = nn.Parameter(view, requires_grad=old.requires_grad)
            laid += 1
    state = {
        name: homed[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in homed
    }
    model.load_state_dict(state, strict=False, assign=True)
    return laid


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter, gathered one at a time (`DTensor.full_tensor()`).

    A collective: every rank must iterate to the end in the same order; typically only rank 0
    uses the tensors (weight sync broadcasts them to inference servers). Tied weights appear once.
    On one rank the tensors are the parameters themselves, in place: the pairs come `Resident`."""
    reshard_units(model)
    pairs = ((name, full(param)) for name, param in model.named_parameters())
    return Resident(pairs) if all(in_place(p) for p in model.parameters()) else pairs


def local_shards(model: nn.Module) -> Iterator[LocalShard]:
    """This rank's piece of every parameter of an FSDP2 (or FSDP2 + TP) model, in place, with its
    DTensor placement; the model is put back in its sharded state first."""
    reshard_units(model)
    for name, param in model.named_parameters():
        data = param.detach()
        if hasattr(data, "to_local"):
            yield LocalShard(name, data.to_local(), tuple(data.placements), data.device_mesh, data.shape)
        else:
            yield LocalShard(name, data, (), None, data.shape)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (a collective; the dict is complete on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard_units(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_hf(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer_path: str | Path | None,
    rank: int,
    kind: PartKind = "policy",
) -> Path:
    """Write a plain HF checkpoint (safetensors + config + tokenizer) that servers load as-is
    (`kind="value"`: a one-label `AutoModelForTokenClassification`, the critic)."""
    state = full_state_dict(model)
    out = Path(out_dir)
    if rank == 0:
        hf_model.save_plain(state, model.config, kind, out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
        if tokenizer_path is not None:
            copy_tokenizer(Path(tokenizer_path), out)
    if dist.is_initialized():
        dist.barrier()
    return out


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer(src: Path, out: Path) -> None:
    """Copy the tokenizer files byte for byte (re-saving can rewrite the class name or template)."""
    import shutil

    found = [name for name in TOKENIZER_FILES if (src / name).exists()]
    if found:
        for name in found:
            shutil.copyfile(src / name, out / name)
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def first_nonfinite(named: list[tuple[str, torch.Tensor]], device: torch.device) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, over every rank's (local)
    tensors: a fused L1 norm per tensor (`torch._foreach_norm`, as `clip_grad_norm_` uses; a NaN or
    inf makes it non-finite, an L1 norm overflows only beyond 3e38) and one all-reduce (MIN) of the
    first bad index, so every rank names the same tensor."""
    first = len(named)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, tensor) in enumerate(named):
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(i)
    for indices in by_kind.values():
        norms = torch._foreach_norm([named[i][1] for i in indices], 1)
        bad = (~torch.isfinite(torch.stack(norms))).nonzero()
        if bad.numel():
            first = min(first, indices[int(bad[0])])
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        first = int(t)
    return named[first][0] if first < len(named) else None


class FSDP2Backend:
    """`LearnerBackend` on FSDP2 (see `backend.py` for the contract of each method).

    The process group is made at construction (`init_distributed`). Trained parts get a fused
    AdamW over their DTensor shards: foreach on DTensors dispatches per tensor and was ~100x
    slower per step on CPU (torch 2.13), which dominated small models' step time."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.device = init_distributed()
        self.dp_rank, self.dp_size = self.rank, self.world_size

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
        # `shard` replaces the default FSDP2 wrapping (the colocated HybridEngine shards each
        # parameter on its TP dim so that training shards lie inside generation shards); `lora`
        # (a `learner.lora.LoraConfig`) wraps the policy with PEFT before it is sharded
        if kind == "policy":
            module = load_model(path, self.device)
        else:
            module = hf_model.load_value_model(path, self.device)
        if lora is not None:
            from agentrl.learner import lora as adapters

            module = adapters.apply(module, lora)
        if shard is not None:
            module = shard(module)
        else:
            module = shard_model(module, self.device, bf16, activation_checkpointing and optim is not None)
            if push_buckets and self.world_size == 1 and lora is None:
                log.info("%s: weights laid out in %d weight-push bucket(s)", name,
                         home_for_push(module, push_buckets))  # fmt: skip
        if optim is None:
            module.eval().requires_grad_(False)
            return ModelPart(name, kind, module)
        module.train()
        trained = [p for p in module.parameters() if p.requires_grad]  # a LoRA policy: the adapter's
        optimizer = torch.optim.AdamW(trained, lr=optim.lr, betas=optim.adam_betas,
                                      weight_decay=optim.weight_decay, fused=True)  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda or (lambda step: 1.0))
        return ModelPart(name, kind, module, optimizer, scheduler)

    def logprobs(
        self, part: ModelPart, mb: MicroBatch, temperature: float = 1.0, entropy: str = "none"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hf_model.forward_logprobs(part.module, mb, temperature, entropy)

    def values(self, part: ModelPart, mb: MicroBatch) -> torch.Tensor:
        return hf_model.values(part.module, mb)

    @contextlib.contextmanager
    def frozen(self, part: ModelPart) -> Iterator[None]:
        was_training = part.module.training
        part.module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            part.module.train(was_training)

    @staticmethod
    def adapter_disabled(part: ModelPart) -> ModelPart:
        from agentrl.learner.lora import AdapterDisabled

        return ModelPart("ref", "policy", AdapterDisabled(part.module))

    @staticmethod
    def adapter_tensors(part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        from agentrl.learner import lora

        return lora.adapter_tensors(part.module)

    @staticmethod
    def merged_tensors(part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        from agentrl.learner import lora

        return lora.merged_tensors(part.module)

    def forward_backward(
        self, part: ModelPart, mbs: list[MicroBatch], loss_fn: Callable[[MicroBatch], torch.Tensor]
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        model = part.module
        part.optimizer.zero_grad(set_to_none=True)
        # One rank: keep parameters gathered and gradients unreduced until the last micro-batch
        # (nothing to communicate, and no extra memory: the unsharded size is the sharded size).
        # Several ranks reduce-scatter after every micro-batch, which keeps gradients sharded.
        accumulate = self.world_size == 1 and isinstance(model, FSDPModule) and len(mbs) > 1
        for i, mb in enumerate(mbs):
            if accumulate:
                model.set_requires_gradient_sync(i == len(mbs) - 1)
                model.set_reshard_after_backward(i == len(mbs) - 1)
            (loss_fn(mb) * self.world_size).backward()  # FSDP averages gradients over ranks

    def optimizer_step(self, part: ModelPart, max_grad_norm: float, skip: bool = False) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(part.module.parameters(), max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        applied = math.isfinite(norm) and not skip
        if applied:
            self._checked_step(part)
        part.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def _checked_step(self, part: ModelPart) -> None:
        """The AdamW and LR-schedule step between two finiteness checks (`NonFiniteError`): of the
        optimizer state it reads (the gradients' is the clipped norm's), so that a corrupt state
        leaves the weights untouched, and of the weights it wrote, so that none is pushed or saved.
        Each is one fused pass over this rank's shards and one all-reduce."""
        self._refuse_nonfinite(
            part, "state", "is not finite: the optimizer step was not taken and the weights are those of the "
            "last version (the optimizer state comes from the checkpoint resumed or an earlier step; resume "
            "from an earlier checkpoint)",
        )  # fmt: skip
        lr = part.lr
        part.optimizer.step()
        part.scheduler.step()
        self._refuse_nonfinite(part, "params", f"is not finite after the optimizer step (lr {lr:g}): not "
                               "pushed and not saved; the last checkpoint holds the last good weights")  # fmt: skip

    def _refuse_nonfinite(self, part: ModelPart, which: Literal["state", "params"], outcome: str) -> None:
        bad = self.first_nonfinite(part, params=which == "params", state=which == "state")
        if bad is not None:
            part.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{bad} of the {part.name} {outcome}")

    def first_nonfinite(self, part: ModelPart, params: bool = True, state: bool = True) -> str | None:
        named: list[tuple[str, torch.Tensor]] = []
        for name, param in part.module.named_parameters():
            if part.trainable and not param.requires_grad:
                continue  # frozen (a LoRA policy's base): no step changes it
            if params:
                named.append((name, _local(param.detach())))
            if state and part.optimizer is not None:
                for key, value in part.optimizer.state.get(param, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        named.append((f"{name} ({key})", _local(value)))
        return first_nonfinite(named, self.device)

    def all_reduce(self, values: dict[str, float], op: Literal["sum", "max"]) -> dict[str, float]:
        if not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return dict(zip(values, t.tolist(), strict=True))

    def broadcast_object(self, obj: Any) -> Any:
        payload = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def full_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_full_tensors(part.module)

    def local_shards(self, part: ModelPart) -> Iterator[LocalShard]:
        return local_shards(part.module)

    @staticmethod
    def _options(part: ModelPart) -> Any:
        """A part with frozen parameters (a LoRA policy's base) saves and loads only its trained
        ones: the frozen ones come from `learner.model_path` at every start."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in part.module.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None

    def _state(self, parts: list[ModelPart]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = {}
        for part in parts:
            options = self._options(part)
            model_sd, optim_sd = get_state_dict(part.module, part.optimizer, options=options)
            if options is not None:  # a frozen weight tied to another (lm_head) is still listed: drop it
                trained = {n for n, p in part.module.named_parameters() if p.requires_grad}
                model_sd = {k: v for k, v in model_sd.items() if k in trained}
            prefix = "" if part.name == "actor" else f"{part.name}."
            state[f"{prefix}model"], state[f"{prefix}optim"] = model_sd, optim_sd
        return state

    def save(self, parts: list[ModelPart], path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(parts), checkpoint_id=str(path))
        for part in parts:  # a LoRA policy's checkpoint also holds its adapter in PEFT's format
            if hasattr(part.module, "peft_config"):
                from agentrl.learner import lora

                tensors = dict(lora.adapter_tensors(part.module))  # a collective
                if self.rank == 0:
                    lora.write_peft_dir(path / f"{part.name}_adapter", tensors, part.module)

    def load(self, parts: list[ModelPart], path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(parts)
        dcp.load(state, checkpoint_id=str(path))
        for part in parts:
            prefix = "" if part.name == "actor" else f"{part.name}."
            set_state_dict(part.module, part.optimizer, model_state_dict=state[f"{prefix}model"],
                           optim_state_dict=state[f"{prefix}optim"], options=self._options(part))  # fmt: skip

    def export(self, part: ModelPart, out_dir: Path, tokenizer_path: str | Path | None) -> Path:
        return export_hf(part.module, out_dir, tokenizer_path, self.rank, part.kind)
