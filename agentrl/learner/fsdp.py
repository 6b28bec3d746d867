"""Process group, model loading and FSDP2 sharding, and full-weight gathering.

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

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from agentrl.log import get_logger

log = get_logger("learner.fsdp")


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises the default process group if needed."""
    use_cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if use_cuda else "gloo")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


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


def _reshard(model: nn.Module) -> None:
    """Units kept gathered after a forward (`reshard_after_forward=False`) expose their compute
    copies (bf16 under mixed precision) as parameters until resharded: go back to the fp32 shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # each unit reshards only its own parameters
        if isinstance(module, FSDPModule):
            module.reshard()


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter, gathered one at a time (`DTensor.full_tensor()`).

    A collective: every rank must iterate to the end in the same order; typically only rank 0
    uses the tensors (weight sync broadcasts them to inference servers). Tied weights appear once."""
    _reshard(model)
    for name, param in model.named_parameters():
        data = param.detach()
        yield name, data.full_tensor() if hasattr(data, "full_tensor") else data


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU (a collective; the dict is complete on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_hf(model: nn.Module, out_dir: str | Path, tokenizer_path: str | Path | None, rank: int) -> Path:
    """Write a plain HF checkpoint (safetensors + config + tokenizer) that servers load as-is."""
    from transformers import AutoModelForCausalLM

    state = full_state_dict(model)
    out = Path(out_dir)
    if rank == 0:
        config = model.config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(state, strict=False, assign=True)
        plain.tie_weights()
        plain.config.use_cache = True
        plain.save_pretrained(out, safe_serialization=True)
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
