"""The Megatron backend's model (`megatron.MegatronBackend` builds and trains it): `MegatronModel`,
one pipeline stage's Megatron-core `GPTModel` with its HF config, layout and HF names;
`ValueHead`, the critic's scalar head in the place of the vocabulary; `causal_mask` for packed
rows; the embedding hooks that reproduce HF behaviour Megatron lacks (`padding_idx`,
`grad_through`); and `load_hf`, which copies a rank's TP shard of each parameter from an HF
safetensors checkpoint (`HFTensors`). For mixture-of-experts models: `layer_spec` (Megatron's local
MoE layers, as `replicated_experts_moe()`) and `RoutingReplay`, which routes tokens to recorded
experts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.learner import megatron_convert as convert
from agentrl.learner import megatron_lora
from agentrl.learner.backend import PartKind


class MegatronModel(nn.Module):
    """The GPTModel of one pipeline stage (`gpt`), with the HF config it was built from
    (`config`: what the loop reads, e.g. `vocab_size`), its layout (`shape`) and its `kind`: a
    policy, or a value model whose last stage ends in a `ValueHead` instead of the vocabulary."""

    def __init__(self, gpt: nn.Module, hf_config: Any, shape: convert.Shape, kind: PartKind) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = hf_config
        self.shape = shape
        self.kind = kind
        # with `learner.lora` (`megatron_lora.attach`): the adapters' PEFT names and TP split dims
        self.lora: Any = None
        self.base_path = ""
        self.adapter_names: dict[str, str] = {}
        self.adapter_dims: dict[str, int | None] = {}
        self.switch = megatron_lora.Switch()
        # an MoE model's routers with their position among the MoE layers (`RoutingReplay`)
        self.routers: list[tuple[int, nn.Module]] = []

    def base_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The GPTModel's own parameters (the adapters left out), by Megatron name."""
        return ((n, p) for n, p in self.gpt.named_parameters() if n not in self.adapter_names)

    def hf_names(self, name: str) -> tuple[str, ...]:
        if self.kind == "value" and name.startswith("output_layer."):
            return ("score." + name.rpartition(".")[2],)  # HF's token-classification head
        layers = self.gpt.decoder.layers
        return convert.hf_names(name, lambda local: layers[local].layer_number - 1, self.shape)

    def partition_dim(self, name: str) -> int | None:
        """`convert.partition_dim`; a value head is replicated over the TP group; an adapter's
        split is its base layer's (`megatron_lora`)."""
        if name in self.adapter_dims:
            return self.adapter_dims[name]
        if self.kind == "value" and name.startswith("output_layer."):
            return None
        return convert.partition_dim(name)


def layer_spec(config: Any, shape: convert.Shape) -> Any:
    """The decoder's layer spec: Megatron's local (non-Transformer-Engine) layers; for an MoE model
    the per-layer block spec (sparse or dense by `moe_layer_freq`; experts as `SequentialMLP`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not shape.experts:
        return get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    _router_gemm_without_te()
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def replayable_moe(module: MegatronModel) -> None:
    """Make the model's MoE layers `replicated_experts_moe()` (the class of the built layer is
    swapped, so Megatron's spec keeps building them with their process groups) and give each
    router a `RoutingReplay`, kept in `module.routers` with its MoE-layer position."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in module.gpt.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.__class__ = replicated_experts_moe()
            layer.mlp.router.router_replay = RoutingReplay()
            module.routers.append((module.shape.moe_index(layer.layer_number - 1), layer.mlp.router))


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router linear (transformer/moe/moe_utils.py,
    `RouterGatingLinearFunction`) tests `te_general_gemm is not None`, a name the module defines
    only when Transformer Engine imports: without it every MoE forward raises NameError. Defined
    here as None (what the test means: no TE GEMM), which takes its plain `torch.mm` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@functools.cache
def replicated_experts_moe() -> type:
    """`ReplicatedExpertsMoE`: Megatron's `MoELayer` (imported only when an MoE model is built)
    without its refusal to train under tensor parallel without sequence parallel (moe_layer.py,
    `MoELayer.forward`, raised as a performance guard: "performance may degrade").

    Here the routed experts are whole on every TP rank (expert tensor parallel 1,
    `megatron_convert.moe_config`) and the token dispatcher moves nothing, so each TP rank routes
    and computes the same (replicated) tokens with the same weights, as it does its norms, and the
    gradients of the experts and the router are complete on every rank, like the norms'. (Experts
    split over TP without sequence parallel would each see every token once per rank.) Only the
    layer's own `training` flag is lowered around the call; the router's, which decides the
    auxiliary losses, is untouched (they are off in any case)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class ReplicatedExpertsMoE(MoELayer):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            training, self.training = self.training, False
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.training = training

    return ReplicatedExpertsMoE


class RoutingReplay:
    """Routes each token to recorded experts, in megatron-core 0.16.1's routing-replay seam: a
    `TopKRouter`'s `router_replay` is asked for the top-k (`moe_utils.topk_routing_with_score_function`
    calls `get_replay_topk(scores, topk, num_groups, group_topk, default)`) and returns the scores
    gathered at the chosen experts, from which Megatron computes the gate weights as for its own
    choice (softmax over the k chosen logits, or the softmax scores themselves). So the weights
    come from the learner's own router logits at the replayed experts and the router keeps its
    gradient, as `agentrl/moe.py` does for transformers' routers.

    `target` ([tokens, top_k] in the router's token order, or None: the router's own top-k); a
    token whose row holds any -1 (nothing recorded) keeps the router's own choice. Megatron's own
    `RouterReplay` gathers at the target unconditionally and keeps its instances in a process-wide
    list, so it is not used."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Any = None,
        group_topk: Any = None,
        default: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default(scores, topk, num_groups, group_topk)
        if self.target is None:
            return values, own
        recorded = self.target.to(device=own.device, dtype=own.dtype)
        if recorded.shape != own.shape:
            raise ValueError(f"router replay: the router routes {tuple(own.shape)} tokens × top-k, the "
                             f"recorded experts are {tuple(recorded.shape)}")  # fmt: skip
        index = torch.where((recorded < 0).any(dim=-1, keepdim=True), own, recorded)
        return scores.gather(1, index), index


class ValueHead(nn.Linear):
    """The critic's scalar head (HF's `score`: hidden -> 1 with a bias), in the place of the
    GPTModel's vocabulary-parallel output layer and called as it is. Every TP rank holds it whole
    and computes the same values from the same (replicated) final hidden states, so neither its
    output nor the gradient it sends back needs a TP collective."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden, 1, bias=True)

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        return super().forward(hidden), None


def causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's attention mask (True = masked, [rows, 1, T, T]) for packed rows: each position
    attends to the earlier positions of its own sequence (sequences start where position ids
    restart at 0)."""
    seq = (position_ids == 0).cumsum(-1)
    same = seq[:, :, None] == seq[:, None, :]
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ~(same & causal)[:, None]


def padding_idx(embedding: nn.Module, pad_id: int) -> None:
    """HF's `nn.Embedding(..., padding_idx=pad_token_id)` (Qwen2/Qwen3/Llama): the pad token's
    input-embedding row gets no gradient from its lookups (the tied output side still trains
    it). Megatron's embedding has no padding index, so the lookup's output gradient is zeroed
    at pad positions."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            pad = (args[0] == pad_id)[..., None]
            output.register_hook(lambda grad: grad.masked_fill(pad, 0.0))

    embedding.register_forward_hook(hook)


def grad_through(embedding: nn.Module) -> None:
    """With a frozen embedding and full-layer recompute, the first layer's input must require grad:
    Megatron's `CheckpointFunction` gives an output that needs a gradient only when an input
    does, and the adapters inside the recomputed layer are not its inputs (PEFT's
    `enable_input_require_grads`, for the same reason under HF's gradient checkpointing)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_(True)

    embedding.register_forward_hook(hook)


class HFTensors:
    """The checkpoint's tensors by HF name (all its safetensors files), read one at a time."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files (an HF `from_pretrained` checkpoint)")
        self.path, self.where = path, {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                self.where.update(dict.fromkeys(f.keys(), file))

    def has(self, name: str) -> bool:
        return name in self.where

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            expert = convert.expert_of_fused(name, self) if "mlp.experts." in name else None
            if expert is not None:  # a checkpoint with the experts fused (transformers 5's in-memory names)
                return expert
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint")
        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name)


def load_hf(module: MegatronModel, path: Path, tp: int, tp_rank: int) -> None:
    """Copy TP rank `tp_rank`'s shard of every parameter from the HF checkpoint. A value model's head
    starts at zero (every value 0, as `hf_model.load_value_model`), unless the checkpoint has
    one (an exported critic)."""
    read = HFTensors(path)
    with torch.no_grad():
        for name, param in module.base_parameters():
            names = module.hf_names(name)
            if module.kind == "value" and name.startswith("output_layer.") and not read.has(names[0]):
                param.zero_()
                continue
            full = convert.to_megatron(name, [read(n) for n in names], module.shape, tp)
            dim = module.partition_dim(name)
            if dim is not None:
                full = full.chunk(tp, dim=dim)[tp_rank]
            if full.shape != param.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(full.shape)} for this rank, the model "
                                 f"{tuple(param.shape)}")  # fmt: skip
            param.copy_(full)
