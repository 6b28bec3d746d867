"""Hugging Face <-> Megatron-core GPT: the model config and the weight layout, both ways.

Covers the Qwen2 / Qwen3 / Llama families (GQA, SwiGLU, RMSNorm, rotary, optional q/k/v bias,
optional q/k norms, tied or untied embeddings). Two layouts meet here:

- Megatron fuses q, k and v into one `linear_qkv` whose rows are grouped per key/value head:
  for each of the `g` groups, that group's `h/g` query heads, then its key head, then its value
  head. Tensor parallel splits these rows into contiguous runs of whole groups. Concatenating
  q, k and v without the grouping gives a model that runs and is wrong (a test keeps it out).
- The SwiGLU `linear_fc1` holds gate and up stacked; tensor parallel rank r holds
  [gate_r; up_r], so the "full" Megatron tensor (the TP shards concatenated) interleaves the
  ranks' gate and up slices.

The norm weights' names depend on the layer spec: the local spec (used here on CPU) has
`input_layernorm` and `pre_mlp_layernorm`; the Transformer Engine spec fuses them into the
following linear as `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`. The
mapping below takes either, from the names the built model has.

Conversion is pure re-arrangement (no arithmetic): HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Shape:
    """What the weight layout depends on (from the HF config)."""

    heads: int
    groups: int
    head_dim: int
    hidden: int
    ffn: int
    layers: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool


def shape_of(hf: Any) -> Shape:
    """The layout facts of an HF config; refuses a family or feature not covered here."""
    if hf.model_type not in FAMILIES:
        raise ValueError(f"learner.backend megatron: model_type {hf.model_type!r} is not covered; "
                         f"supported: {', '.join(FAMILIES)} (or use learner.backend fsdp2)")  # fmt: skip
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"learner.backend megatron: hidden_act {hf.hidden_act!r}; only SwiGLU (silu) is mapped"
        )
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"learner.backend megatron: rope scaling {rope} is not mapped; only default RoPE")
    heads = hf.num_attention_heads
    return Shape(
        heads=heads,
        groups=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        hidden=hf.hidden_size,
        ffn=hf.intermediate_size,
        layers=hf.num_hidden_layers,
        vocab=hf.vocab_size,
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=hf.model_type == "qwen3",
    )


def rope_theta(hf: Any) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def tp_local(s: Shape, tp: int) -> Shape:
    """The layout of one TP rank's shard: its heads, key/value groups and feed-forward rows (so
    `to_hf(name, shard, tp_local(s, tp), 1)` gives the HF tensors' TP-local blocks)."""
    return dataclasses.replace(s, heads=s.heads // tp, groups=s.groups // tp, ffn=s.ffn // tp)


def group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """HF q/k/v projections (weights or biases) -> Megatron's `linear_qkv`, grouped per KV head."""
    per = s.heads // s.groups
    tail = q.shape[1:]
    q = q.reshape(s.groups, per * s.head_dim, *tail)
    k = k.reshape(s.groups, s.head_dim, *tail)
    v = v.reshape(s.groups, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def ungroup_qkv(qkv: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `group_qkv`."""
    per = s.heads // s.groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(s.groups, (per + 2) * s.head_dim, *tail)
    q, k, v = grouped.split([per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def stack_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """HF gate/up -> the full `linear_fc1` (TP rank r's rows are [gate_r; up_r])."""
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)])


def unstack_fc1(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `stack_fc1`."""
    pairs = [shard.chunk(2) for shard in fc1.chunk(tp)]
    return torch.cat([g for g, _ in pairs]), torch.cat([u for _, u in pairs])


# Per decoder layer: Megatron suffix -> HF suffixes it is made of. Both specs' norm names.
_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}


def hf_names(name: str, layer_index: Callable[[int], int], s: Shape) -> tuple[str, ...]:
    """The HF tensor names one Megatron parameter is made of. `layer_index` maps the module's
    local layer number (under pipeline parallel each stage numbers its layers from 0) to the
    global one."""
    if name == "embedding.word_embeddings.weight":
        return ("model.embed_tokens.weight",)
    if name == "output_layer.weight":
        return ("model.embed_tokens.weight",) if s.tied else ("lm_head.weight",)
    if name == "decoder.final_layernorm.weight":
        return ("model.norm.weight",)
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        suffix = ".".join(parts[3:])
        if suffix in _LAYER:
            prefix = f"model.layers.{layer_index(int(parts[2]))}."
            return tuple(prefix + h for h in _LAYER[suffix])
    raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


_ROWS = (
    "word_embeddings.weight",
    "output_layer.weight",
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
)
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")


def partition_dim(name: str) -> int | None:
    """The dimension tensor parallel splits a Megatron parameter along (None: replicated):
    vocabulary rows of the embedding and output layer, output rows of the column-parallel
    `linear_qkv` / `linear_fc1`, input columns of the row-parallel `linear_proj` / `linear_fc2`.
    (Megatron marks this on the parameters only when it initialises them itself.)"""
    if name.endswith(_ROWS):
        return 0
    if name.endswith(_COLUMNS):
        return 1
    return None


def to_megatron(name: str, hf: list[torch.Tensor], s: Shape, tp: int) -> torch.Tensor:
    """The full Megatron tensor (TP shards concatenated) of `name` from its HF tensors."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return group_qkv(*hf, s)
    if name.endswith("linear_fc1.weight"):
        return stack_fc1(*hf, tp)
    return hf[0]


def to_hf(name: str, full: torch.Tensor, s: Shape, tp: int) -> tuple[torch.Tensor, ...]:
    """The HF tensors of one full Megatron tensor (`to_megatron`'s inverse), in `hf_names` order."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return ungroup_qkv(full, s)
    if name.endswith("linear_fc1.weight"):
        return unstack_fc1(full, tp)
    return (full,)


def transformer_config(hf: Any, tp: int, pp: int, dtype: torch.dtype, recompute: bool) -> Any:
    """Megatron's `TransformerConfig` for the HF config, with every fusion off (they need CUDA
    or Transformer Engine) and per-token loss (the learner's loss is already normalised)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = shape_of(hf)
    if s.groups % tp or s.heads % tp or s.vocab % tp:
        raise ValueError(f"learner.megatron.tp {tp}: must divide the model's {s.heads} heads, {s.groups} "
                         f"key/value heads and {s.vocab} vocabulary rows")  # fmt: skip
    if s.layers % pp:
        raise ValueError(f"learner.megatron.pp {pp}: must divide the model's {s.layers} layers")
    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        ffn_hidden_size=s.ffn,
        num_attention_heads=s.heads,
        num_query_groups=s.groups,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # MoE is not used; the default refuses variable lengths
        **(extra if recompute else {}),
    )
