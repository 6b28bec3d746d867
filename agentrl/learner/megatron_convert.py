"""Hugging Face <-> Megatron-core GPT: the model config and the weight layout, both ways.

Covers the Qwen2 / Qwen3 / Llama families (GQA, SwiGLU, RMSNorm, rotary, optional q/k/v bias,
optional q/k norms, tied or untied embeddings) and their mixture-of-experts forms Qwen2-MoE and
Qwen3-MoE (`moe_config`). Two layouts meet here:

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

A sparse layer's MLP is Megatron's `MoELayer`: `mlp.router.weight` is HF's `mlp.gate.weight`,
expert e's `mlp.experts.local_experts.<e>.linear_fc1/fc2` are HF's `mlp.experts.<e>.gate_proj/up_proj
/down_proj`, and Qwen2-MoE's shared expert is `mlp.shared_experts.linear_fc1/fc2` with its sigmoid
gate `mlp.shared_experts.gate_weight` (HF `mlp.shared_expert_gate.weight`). The routed experts are
not split by tensor parallel (expert tensor parallel 1, expert parallel 1): every TP rank holds
them whole, like the norms; the shared expert is split as a dense MLP.

Conversion is pure re-arrangement (no arithmetic): HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")


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
    # mixture of experts (0 experts: a dense model)
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0  # 0: no shared expert (Qwen3-MoE)
    norm_topk: bool = False
    sparse: tuple[bool, ...] = ()  # per layer: an MoE layer (else a dense MLP of width `ffn`)

    def moe_index(self, layer: int) -> int:
        """The position of global layer `layer` among the MoE layers (the layer axis of recorded
        routing, `agentrl/moe.py`)."""
        return sum(self.sparse[:layer])


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
        qkv_bias=hf.model_type == "qwen2"
        or bool(getattr(hf, "qkv_bias", False) or getattr(hf, "attention_bias", False)),
        qk_norm=hf.model_type in ("qwen3", "qwen3_moe"),
        **(_moe_shape(hf) if hf.model_type.endswith("_moe") else {}),
    )


def _moe_shape(hf: Any) -> dict[str, Any]:
    """The MoE fields of `Shape` for Qwen2-MoE / Qwen3-MoE: layer i is sparse unless listed in
    `mlp_only_layers`, every `decoder_sparse_step`-th layer (as their decoder layers decide)."""
    step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", []) or [])
    return dict(
        experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_ffn=hf.moe_intermediate_size,
        shared_ffn=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
        norm_topk=bool(hf.norm_topk_prob),
        sparse=tuple(
            i not in dense and hf.num_experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)
        ),
    )


def rope_theta(hf: Any) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def tp_local(s: Shape, tp: int) -> Shape:
    """The layout of one TP rank's shard: its heads, key/value groups and feed-forward rows (so
    `to_hf(name, shard, tp_local(s, tp), 1)` gives the HF tensors' TP-local blocks)."""
    return dataclasses.replace(
        s, heads=s.heads // tp, groups=s.groups // tp, ffn=s.ffn // tp, shared_ffn=s.shared_ffn // tp
    )


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
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


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
        prefix = f"model.layers.{layer_index(int(parts[2]))}."
        if suffix in _LAYER:
            return tuple(prefix + h for h in _LAYER[suffix])
        expert = _EXPERT.fullmatch(suffix)
        if expert:
            e = prefix + f"mlp.experts.{expert[1]}."
            return (
                (e + "gate_proj.weight", e + "up_proj.weight")
                if expert[2] == "1"
                else (e + "down_proj.weight",)
            )
    raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_experts(
    tensors: Iterator[tuple[str, torch.Tensor]], experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5 holds an MoE layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
    [E, 2·I, H] (expert e's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], and
    writes them per expert on disk (`mlp.experts.<e>.gate_proj.weight`, ...; `hf_names`' names).
    `tensors` with each layer's per-expert tensors replaced by the two fused ones (the names the
    FSDP2 backend and the embedded engine's model have), yielded once the layer's last expert
    passed; other tensors pass through."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _HF_EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer = pending.setdefault(match[1], {})
        layer[int(match[2]), match[3]] = tensor
        if len(layer) == 3 * experts:
            del pending[match[1]]
            yield (
                f"{match[1]}.gate_up_proj",
                torch.stack(
                    [torch.cat([layer[e, "gate_proj"], layer[e, "up_proj"]]) for e in range(experts)]
                ),
            )
            yield f"{match[1]}.down_proj", torch.stack([layer[e, "down_proj"] for e in range(experts)])
    if pending:
        raise ValueError(f"fuse_experts: experts missing from {sorted(pending)}")


def expert_of_fused(name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The per-expert tensor `name` (`mlp.experts.<e>.gate_proj.weight`, ...) cut from a checkpoint
    that stores the fused `gate_up_proj` / `down_proj` (`fuse_experts`' layout); None if `name` is
    not an expert's."""
    match = _HF_EXPERT.fullmatch(name)
    if match is None:
        return None
    e = int(match[2])
    if match[3] == "down_proj":
        return read(f"{match[1]}.down_proj")[e]
    return read(f"{match[1]}.gate_up_proj")[e].chunk(2)[0 if match[3] == "gate_proj" else 1]


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
    The routed experts are whole on every TP rank (expert tensor parallel 1).
    (Megatron marks this on the parameters only when it initialises them itself.)"""
    if ".mlp.experts." in name:
        return None
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
        return stack_fc1(*hf, 1 if ".mlp.experts." in name else tp)
    return hf[0]


def to_hf(name: str, full: torch.Tensor, s: Shape, tp: int) -> tuple[torch.Tensor, ...]:
    """The HF tensors of one full Megatron tensor (`to_megatron`'s inverse), in `hf_names` order."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return ungroup_qkv(full, s)
    if name.endswith("linear_fc1.weight"):
        return unstack_fc1(full, 1 if ".mlp.experts." in name else tp)
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
    fields = dict(
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
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable lengths
        **(extra if recompute else {}),
    )
    return TransformerConfig(**(fields | (moe_config(s, tp, pp) if s.experts else {})))


def moe_config(s: Shape, tp: int, pp: int) -> dict[str, Any]:
    """`TransformerConfig` fields of a Qwen2-MoE / Qwen3-MoE model (megatron-core 0.16.1,
    transformer/moe/). The router reproduces transformers' `Qwen2MoeTopKRouter`: softmax scores;
    with `norm_topk_prob` Megatron's top-k of the logits then a softmax over the k chosen (equal to
    the softmax over all experts renormalised at the top k), without it the softmax over all
    experts then top-k (`moe_router_pre_softmax`), unnormalised. No auxiliary loss, as the FSDP2
    learner (transformers adds `router_aux_loss_coef` only with `output_router_logits`, off in
    these configs), no z-loss, no token dropping. The routed experts are whole on every TP rank
    (`expert_tensor_parallel_size` 1) and not spread over ranks (expert parallel 1).

    Token dispatcher: with one pipeline stage the all-gather dispatcher, which with expert
    parallel 1 and expert tensor parallel 1 communicates nothing and runs on CPU; it refuses
    `variable_seq_lengths`, which only the pipeline's send/receive needs. Under pipeline parallel
    the all-to-all dispatcher, which needs CUDA (its constructor creates a `torch.cuda.Stream`,
    token_dispatcher.py `MoEAlltoAllTokenDispatcher.__init__`)."""
    if pp > 1 and not torch.cuda.is_available():
        raise ValueError(
            f"learner.megatron.pp {pp} with the mixture-of-experts model: Megatron's all-to-all token "
            "dispatcher (the one that takes pipeline parallel's variable lengths) needs CUDA; use pp 1 on CPU"
        )
    if s.shared_ffn % tp:
        raise ValueError(f"learner.megatron.tp {tp}: must divide the shared expert's width {s.shared_ffn}")
    return dict(
        num_moe_experts=s.experts,
        moe_ffn_hidden_size=s.moe_ffn,
        moe_router_topk=s.top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not s.norm_topk,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_layer_freq=[int(x) for x in s.sparse],
        moe_shared_expert_intermediate_size=s.shared_ffn or None,
        moe_shared_expert_gate=bool(s.shared_ffn),
        moe_grouped_gemm=False,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        **({} if pp > 1 else {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}),
    )
