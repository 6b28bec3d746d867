"""LoRA adapters on the Megatron backend's tensor-parallel linear layers (`learner.lora` with
`learner.backend: megatron`), kept in PEFT's layout.

Every adapted Hugging Face Linear gets its own A (rank x in) and B (out x rank), scaled by
alpha / rank, A initialised as PEFT does (Kaiming-uniform) and B at zero, held by the Megatron
layer it is fused into and added to that layer's output by a forward hook:

    q_proj, k_proj, v_proj -> linear_qkv   column parallel; the three deltas grouped per key/value
                                           head, as the base's output rows are
    o_proj                 -> linear_proj  row parallel
    gate_proj, up_proj     -> linear_fc1   column parallel; this rank's [gate_r; up_r]
    down_proj              -> linear_fc2   row parallel

Tensor parallel splits each adapter as its base layer. Column parallel: A is replicated and B
holds this rank's output rows (the HF rows of this rank's heads or feed-forward slice); the
rank-wide `A x` passes `copy_to_tensor_model_parallel_region`, so in backward its gradient is
summed over the TP group and A's gradient (and the input's) is whole on every rank. Row
parallel: A holds this rank's input columns and B is replicated; the rank-wide partial `A x_r`
is all-reduced in forward (`reduce_from_tensor_model_parallel_region`): the same sum as adding
the adapter's partial output to the base's before its all-reduce, sent rank-wide instead of
output-wide. Dropout (while training) draws its mask over the whole input from the default
generator, which every TP rank holds in step, and each rank keeps its slice: the TP ranks agree
with each other and with one unsplit layer.

Adapters are named as PEFT saves them (`base_model.model.model.layers.<i>.self_attn.q_proj.
lora_A.weight`); their initialisation depends on `learner.seed` and the module's HF name only, so
every tp x pp layout starts from the same adapter. The KL reference is the same model with its
adapters switched off (`AdapterDisabled`): no second copy of the base.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agentrl.learner import megatron_convert as convert
from agentrl.learner.lora import PEFT_PREFIX, LoraConfig, matches

if TYPE_CHECKING:
    from agentrl.learner.megatron_model import MegatronModel

CHILD = "lora"  # the adapters' module under their layer: `...linear_qkv.lora.adapters.q_proj.lora_A`

# HF Linear (inside a decoder layer) -> (its Megatron layer, column or row parallel)
LAYERS = {
    "self_attn.q_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.k_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.v_proj": ("self_attention.linear_qkv", "column"),
    "self_attn.o_proj": ("self_attention.linear_proj", "row"),
    "mlp.gate_proj": ("mlp.linear_fc1", "column"),
    "mlp.up_proj": ("mlp.linear_fc1", "column"),
    "mlp.down_proj": ("mlp.linear_fc2", "row"),
}
UNMAPPED = ("lm_head",)  # HF Linear modules with no adapter here (the vocabulary-parallel output layer)


def hf_linear_names(layers: int) -> list[str]:
    """The HF model's Linear modules, as PEFT matches `target_modules` against them."""
    names = [f"model.layers.{i}.{suffix}" for i in range(layers) for suffix in LAYERS]
    return names + list(UNMAPPED)


def targets(cfg: LoraConfig, layers: int) -> set[str]:
    """The HF modules (`model.layers.<i>.self_attn.q_proj`, ...) `cfg.target_modules` adapts, by
    PEFT's matching rule. Raises ValueError naming each entry that matches no Linear module or
    matches one that has no Megatron adapter, and `modules_to_save` (not on this backend)."""
    names = hf_linear_names(layers)
    problems, chosen = [], set()
    for target in cfg.target_modules:
        matched = [n for n in names if matches(n, target)]
        unmapped = [n for n in matched if n in UNMAPPED]
        if not matched:
            near = sorted({n.rsplit(".", 1)[-1] for n in names})
            problems.append(f"target_modules entry {target!r} matches no Linear module (the model's: {near})")
        elif unmapped:
            problems.append(
                f"target_modules entry {target!r} matches {unmapped}, which the Megatron backend cannot adapt "
                f"(it adapts {sorted({s.rsplit('.', 1)[-1] for s in LAYERS})}; or use learner.backend: fsdp2)"
            )
        chosen.update(n for n in matched if n not in UNMAPPED)
    if cfg.modules_to_save:
        problems.append(
            f"modules_to_save {cfg.modules_to_save}: the Megatron backend trains adapters only "
            "(use learner.backend: fsdp2 to train whole modules beside them)"
        )
    if problems:
        raise ValueError(f"learner.lora (learner.backend megatron): {'; '.join(problems)}")
    return chosen


def _sizes(short: str, s: convert.Shape) -> tuple[int, int]:
    """(in, out) of an HF Linear of the model, whole."""
    q, kv = s.heads * s.head_dim, s.groups * s.head_dim
    return {"q_proj": (s.hidden, q), "k_proj": (s.hidden, kv), "v_proj": (s.hidden, kv), "o_proj": (q, s.hidden),
            "gate_proj": (s.hidden, s.ffn), "up_proj": (s.hidden, s.ffn), "down_proj": (s.ffn, s.hidden)}[short]  # fmt: skip


class Adapter(nn.Module):
    """One HF Linear's adapter, this rank's piece: `lora_A` [rank, in], `lora_B` [out, rank], each
    split over the TP group along `dims[name]` (None: replicated)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, column: bool) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.dims = {"lora_A": None, "lora_B": 0} if column else {"lora_A": 1, "lora_B": None}


class Switch:
    """Whether a model's adapters apply (off while the model runs as its own KL reference)."""

    def __init__(self) -> None:
        self.on = True


class ParallelLora(nn.Module):
    """The adapters of one Megatron parallel linear layer, by HF short name (`q_proj`, ...),
    and how their outputs are laid out in the layer's output (`forward` gives that delta)."""

    def __init__(self, layer: str, column: bool, adapters: dict[str, Adapter], local: convert.Shape,
                 cfg: LoraConfig, tp: int, tp_rank: int, switch: Switch) -> None:  # fmt: skip
        super().__init__()
        self.layer, self.column = layer, column
        self.adapters = nn.ModuleDict(adapters)
        self.local, self.tp, self.tp_rank, self.switch = local, tp, tp_rank, switch
        self.scaling, self.dropout, self.rank = cfg.alpha / cfg.rank, cfg.dropout, cfg.rank

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's dropout on the adapter's input, the mask drawn over the whole (unsplit) input."""
        if not self.training or self.dropout == 0:
            return x
        shards = 1 if self.column else self.tp
        keep = torch.rand(*x.shape[:-1], x.shape[-1] * shards, device=x.device, dtype=x.dtype) >= self.dropout
        return x * keep.chunk(shards, dim=-1)[self.tp_rank] / (1 - self.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        names = list(self.adapters)
        h = torch.cat([self._drop(x) @ self.adapters[n].lora_A.t() for n in names], dim=-1)
        if self.tp > 1:
            region = (
                copy_to_tensor_model_parallel_region
                if self.column
                else reduce_from_tensor_model_parallel_region
            )
            h = region(h)
        deltas = {n: part @ self.adapters[n].lora_B.t() * self.scaling
                  for n, part in zip(names, h.split(self.rank, dim=-1), strict=True)}  # fmt: skip
        return self._layout(deltas, x)

    def _layout(self, deltas: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The deltas in the layer's output order: q/k/v grouped per key/value head (as
        `megatron_convert.group_qkv` lays out rows), gate then up, or the one delta."""
        s, lead = self.local, x.shape[:-1]

        def piece(name: str, width: int) -> torch.Tensor:
            return deltas[name] if name in deltas else x.new_zeros(*lead, width)

        if self.layer.endswith("linear_qkv"):
            per = s.heads // s.groups
            q = piece("q_proj", s.heads * s.head_dim).reshape(*lead, s.groups, per * s.head_dim)
            k = piece("k_proj", s.groups * s.head_dim).reshape(*lead, s.groups, s.head_dim)
            v = piece("v_proj", s.groups * s.head_dim).reshape(*lead, s.groups, s.head_dim)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        if self.layer.endswith("linear_fc1"):
            return torch.cat([piece("gate_proj", s.ffn), piece("up_proj", s.ffn)], dim=-1)
        (delta,) = deltas.values()
        return delta


def _hook(base: nn.Module, args: tuple, output: tuple) -> tuple:
    """The base layer's (output, bias) with its adapters' delta added (when they are on)."""
    lora: ParallelLora = getattr(base, CHILD)
    if not lora.switch.on:
        return output
    out, bias = output
    return out + lora(args[0]), bias


def initial(
    name: str, a_shape: tuple[int, int], b_shape: tuple[int, int], seed: int
) -> tuple[torch.Tensor, ...]:
    """PEFT's initialisation of one adapter, whole: A Kaiming-uniform (a = sqrt 5, as
    `LoraLayer.reset_lora_parameters`), B zero; drawn from a generator seeded by `seed` and the
    module's HF name, so it is the same in every layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(a_shape)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    return a, torch.zeros(b_shape)


def check_stages(chosen: set[str], layers: int, pp: int) -> None:
    """Every pipeline stage (Megatron's even split of the layers) must hold an adapter: a stage
    without one would have nothing to train and no gradient path to send back."""
    held = {int(name.split(".")[2]) * pp // layers for name in chosen}
    empty = sorted(set(range(pp)) - held)
    if empty:
        per = layers // pp
        spans = ", ".join(f"stage {s} (layers {s * per}-{(s + 1) * per - 1})" for s in empty)
        raise ValueError(f"learner.lora: target_modules adapt no layer of pipeline {spans}; target a module "
                         "in every stage's layers, or use a smaller learner.megatron.pp")  # fmt: skip


def attach(
    model: MegatronModel, cfg: LoraConfig, tp: int, tp_rank: int, pp: int, seed: int
) -> dict[str, str]:
    """Add adapters for `cfg.target_modules` to this stage's layers of `model` and freeze everything
    else (only the adapters require grad). Returns {Megatron parameter name: PEFT saved name} of
    the adapters added; their TP split is recorded in `model.adapter_dims`."""
    chosen = targets(cfg, model.shape.layers)
    check_stages(chosen, model.shape.layers, pp)
    local = convert.tp_local(model.shape, tp)
    model.requires_grad_(False)
    names: dict[str, str] = {}
    for index, layer in enumerate(model.gpt.decoder.layers):
        number, device = layer.layer_number - 1, next(layer.parameters()).device
        by_layer: dict[str, tuple[bool, dict[str, Adapter]]] = {}
        for suffix, (where, style) in LAYERS.items():
            hf_module, short = f"model.layers.{number}.{suffix}", suffix.rsplit(".", 1)[1]
            if hf_module not in chosen:
                continue
            column = style == "column"
            fan_in, fan_out = _sizes(short, model.shape)
            a, b = initial(hf_module, (cfg.rank, fan_in), (fan_out, cfg.rank), seed)
            a, b = (a, b.chunk(tp)[tp_rank]) if column else (a.chunk(tp, dim=1)[tp_rank], b)
            by_layer.setdefault(where, (column, {}))[1][short] = Adapter(
                a.to(device).contiguous(), b.to(device).contiguous(), column
            )
            for part in ("lora_A", "lora_B"):
                names[f"decoder.layers.{index}.{where}.{CHILD}.adapters.{short}.{part}"] = (
                    f"{PEFT_PREFIX}{hf_module}.{part}.weight"
                )
        for where, (column, adapters) in by_layer.items():
            base = layer.get_submodule(where)
            base.add_module(
                CHILD, ParallelLora(where, column, adapters, local, cfg, tp, tp_rank, model.switch)
            )
            base.register_forward_hook(_hook)
    for name in names:
        owner, _, leaf = name.rpartition(".")
        model.adapter_dims[name] = model.gpt.get_submodule(owner).dims[leaf]
    return names


def is_adapter(name: str) -> bool:
    return f".{CHILD}.adapters." in name


class AdapterDisabled:
    """The KL reference of a Megatron LoRA actor: the actor's model run with its adapters switched
    off (`MegatronBackend._schedule` enters `off()`). Not an `nn.Module`: it owns no parameters;
    `train` / `eval` reach the actor's model."""

    def __init__(self, model: MegatronModel) -> None:
        self.model = model

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        switch = self.model.switch
        was, switch.on = switch.on, False
        try:
            yield
        finally:
            switch.on = was

    @property
    def gpt(self) -> nn.Module:
        return self.model.gpt

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> AdapterDisabled:
        self.model.train(mode)
        return self

    def eval(self) -> AdapterDisabled:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(())
