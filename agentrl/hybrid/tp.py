"""The tensor-parallel plan of the Qwen2-style models (agentrl/tiny_model.py presets, and real
Qwen2/Qwen2.5 checkpoints of the same architecture), shared by both layouts of the HybridEngine.

torch-native tensor parallel (`torch.distributed.tensor.parallel.parallelize_module`, the plan
style of torchtitan's `parallelize_llama`):

- q/k/v/gate/up projections: `ColwiseParallel` (weight and bias `Shard(0)`); the attention's
  `view(..., -1, head_dim)` then sees `heads/tg` local heads, so `tg` must divide the number of
  key/value heads.
- o/down projections: `RowwiseParallel` (weight `Shard(1)`; the partial sums are all-reduced).
- embeddings and the (tied) lm_head: vocab-parallel, weight `Shard(0)` on the vocab dim — the
  embedding's masked partial lookup is all-reduced, the lm_head's logits are all-gathered to
  full logits. Both modules share one parameter, as the tied checkpoint does.
- RMSNorms and the rotary tables: replicated on every generation rank.

The FSDP side follows the same plan: `fsdp_shard_placement` shards each parameter on its TP dim
(`Shard(1)` for the row-wise ones), so every FSDP shard is a block of the generation shard and
the reshard needs no transpose across groups (see reshard.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.hybrid.layout import ParamSpec, stage_of

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def tp_dim(name: str) -> int | None:
    """The dim the plan splits for parameter `name` (0, 1, or None for replicated)."""
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module in COLWISE or module in VOCAB:
        return 0
    if module in ROWWISE:
        return 1 if leaf == "weight" else None
    return None


def param_specs(model: nn.Module, p: int = 1) -> list[ParamSpec]:
    """The model's parameters (tied ones once, under their first name) as `ParamSpec`s, with the
    FSDP dim equal to the TP dim, and pipeline stages for `p` stages."""
    shapes = [(name, tuple(param.shape)) for name, param in model.named_parameters()]
    return specs_of(shapes, model.config.num_hidden_layers, p)


def specs_of(shapes: list[tuple[str, tuple[int, ...]]], layers: int, p: int = 1) -> list[ParamSpec]:
    """`ParamSpec`s of (name, full shape) pairs of a model with `layers` decoder layers."""
    return [
        ParamSpec(name, shape, tp_dim(name), tp_dim(name) or 0, stage_of(name, layers, p))
        for name, shape in shapes
    ]


def check_tp_degree(config, tg: int) -> None:
    """Raise a clear error if the model's heads or sizes do not split `tg` ways."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tg]
    if bad:
        raise ValueError(f"tensor parallel degree tg={tg} does not divide {', '.join(bad)}")


def tp_plan(model: nn.Module) -> dict:
    """The `parallelize_module` plan, by module path."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(model.config.num_hidden_layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = (
                ColwiseParallel if name in COLWISE else RowwiseParallel
            )()
        for name in ("gate_proj", "up_proj", "down_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = (ColwiseParallel if name in COLWISE else RowwiseParallel)()
    return plan


def fsdp_shard_placement(model: nn.Module):
    """A `fully_shard(shard_placement_fn=...)` that shards each parameter on its TP dim."""
    from torch.distributed.tensor import Shard

    dims = {id(param): tp_dim(name) or 0 for name, param in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        return Shard(dims[id(param)])

    return placement


def tensor_parallelize(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """`parallelize_module` with `tp_plan` over `tp_mesh` (the training and the generation layout
    both use it), the tied embedding re-tied: the plan distributes `embed_tokens` and `lm_head`
    one after the other, which leaves two parameters where the checkpoint has one."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tp_degree(model.config, tp_mesh.size())
    parallelize_module(model, tp_mesh, tp_plan(model))
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def parallelize_generation_model(config, tp_mesh: DeviceMesh) -> nn.Module:
    """A TP-sharded model whose parameters take no memory (meta) until the HybridEngine binds its
    generation buffers to them; the non-persistent rotary tables are rebuilt on the mesh's device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if tp_mesh.size() > 1:  # at tg = 1 plain tensors: a 1-rank DTensor only adds dispatch cost
        tensor_parallelize(model, tp_mesh)
    rebuild_computed_buffers(model, torch.device(tp_mesh.device_type))
    return model.eval()


def empty_model(
    config, device: torch.device, dtype: torch.dtype, mesh: DeviceMesh | None = None
) -> nn.Module:
    """The HF causal LM of `config` with uninitialised parameters (no weights read, none random):
    built on the meta device, tensor-parallel over `mesh` by `tp_plan` when given (each rank
    allocates only its shard), then allocated on `device`; computed buffers rebuilt, tied
    embeddings tied. The caller fills the parameters (`Engine.load_weights`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if mesh is not None and mesh.size() > 1:
        tensor_parallelize(model, mesh)
    model.to_empty(device=device)
    rebuild_computed_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def rebuild_computed_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent buffers (the rotary `inv_freq`) that a meta-device or
    `to_empty` model lacks, from a fresh module of the same class and config."""
    import torch

    for name, module in model.named_modules():
        buffers = getattr(module, "_non_persistent_buffers_set", None)
        if not buffers:
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"{name} ({type(module).__name__}) has computed buffers that cannot be rebuilt")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for buf in buffers:
            module.register_buffer(buf, getattr(fresh, buf), persistent=False)
