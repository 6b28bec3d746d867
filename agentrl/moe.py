"""Mixture-of-experts routing: record the experts a model's routers choose, and replay them.

Router replay (R3): a MoE model's top-k expert choice is a discontinuous function of the weights,
so the learner's forward, on weights that differ from the inference engine's only by rounding or a
small update, can route a token to other experts than the ones that generated it, and its log-probs
then disagree with the behaviour log-probs far more than the numerics would. Replaying the
inference engine's choices in the learner's forward removes that source of mismatch; the gate
weights are still recomputed from the learner's own router logits for the replayed experts (the
softmax over all experts, gathered at the replayed ones, renormalised as the model does), so the
router keeps receiving gradients.

Both sides work on transformers' top-k routers whose forward is softmax over all experts, top-k,
then (with `norm_topk_prob`) renormalisation, returning `(router_logits, top_k_weights,
top_k_index)` for hidden states [N, H]: `Qwen2MoeTopKRouter` and `Qwen3MoeTopKRouter`
(`REPLAYABLE`), one per MoE layer in layer order. Routers of other MoE architectures compute their
weights differently (softmax after top-k, grouped or biased selection) and are not recognised: such
a model counts as having no router here, and the server refuses `return_routed_experts` for it.
The Megatron learner replays the same records inside Megatron-core's router instead
(`learner/megatron_model.py` `RoutingReplay`).

The layout of recorded routing follows SGLang 0.5.23's `return_routed_experts`: one row per token
fed to the model, `[tokens, layers, top_k]` int32; a request's rows cover its prompt and output
except the last output token (never fed back), and `encode_routed_experts` / `decode_routed_experts`
give its base64 form (`meta_info["routed_experts"]`).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPLAYABLE = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
"""Router classes (transformers 5) whose selection and weights `replay_routing` reproduces."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's replayable top-k routers in layer order (empty for a dense model or another MoE)."""
    return [m for m in model.modules() if type(m).__name__ in REPLAYABLE]


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the model, or None for a dense model."""
    found = routers(model)
    return (len(found), int(found[0].top_k)) if found else None


class RoutingRecorder:
    """Forward hooks on every router that keep the experts each forward chose.

    `take()` returns the choices of the forwards since the last `take()` as one int32 tensor
    [layers, N, top_k] (N: the flattened tokens of the forward, rows × positions), or None if
    no forward ran. One forward per `take()`: the engine takes after each prefill / decode step."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = routers(model)
        if not self._routers:
            raise ValueError(
                f"{type(model).__name__} has no top-k router: it is not a mixture-of-experts model"
            )
        self._seen: list[torch.Tensor | None] = [None] * len(self._routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    def _hook(self, layer: int):
        def keep(_module: nn.Module, _args: tuple, output: tuple) -> None:
            self._seen[layer] = output[2].detach()

        return keep

    def take(self) -> torch.Tensor | None:
        seen, self._seen = self._seen, [None] * len(self._routers)
        if any(s is None for s in seen):
            return None
        return torch.stack([s.to(torch.int32) for s in seen])  # type: ignore[misc]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _replaying_forward(router: nn.Module, layer: int, experts: torch.Tensor):
    """A forward for `router` that routes each token to its recorded experts (`experts` [N, layers,
    top_k], -1 where nothing was recorded: that token keeps the router's own top-k)."""

    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        router_logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        recorded = experts[:, layer, :].to(device=own.device, dtype=own.dtype)
        if recorded.shape != own.shape:
            raise ValueError(
                f"router replay: layer {layer} routes {tuple(own.shape)} tokens × top-k, "
                f"the recorded experts are {tuple(recorded.shape)}"
            )
        keep_own = (recorded < 0).any(dim=-1, keepdim=True)
        index = torch.where(keep_own, own, recorded)
        weights = probs.gather(-1, index)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), index

    return forward


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's forward routes every token to the experts in `experts`
    ([N, layers, top_k] for the forward's N = rows × positions flattened tokens, in the layout of
    `input_ids.reshape(-1)`; a row holding any -1 is routed by the model's own top-k). The gate
    weights come from the model's router logits at those experts, so the router gets gradients."""
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no top-k router: router replay needs a MoE model")
    if experts.dim() != 3 or experts.shape[1] != len(found) or experts.shape[2] != found[0].top_k:
        raise ValueError(
            f"router replay: experts of shape {tuple(experts.shape)}, the model has {len(found)} MoE layers "
            f"of top-{found[0].top_k} ([tokens, layers, top_k] expected)"
        )
    for layer, router in enumerate(found):
        router.forward = _replaying_forward(router, layer, experts)
    try:
        yield
    finally:
        for router in found:
            del router.forward  # the instance attribute: the class's forward is back


def encode_routed_experts(experts: np.ndarray) -> str:
    """SGLang's wire form of routed experts: the int32 array's bytes, base64."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(text: str, layers: int, top_k: int) -> np.ndarray:
    """The [tokens, layers, top_k] int32 array of `encode_routed_experts`' output."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if flat.size % (layers * top_k):
        raise ValueError(
            f"routed experts: {flat.size} values are not whole rows of {layers} layers × top-{top_k}"
        )
    return flat.reshape(-1, layers, top_k)
