"""A lean decode step for Qwen2 models: transformers' Qwen2 forward for one new token per row,
without its per-call machinery.

On a small model the decode step is dispatch-bound, not compute-bound: transformers 5's
`Qwen2ForCausalLM.forward` spends ~3 ms per call on CPU for the tiny preset (2 layers, hidden 64)
in output capturing, kwarg deprecation wrappers, config lookups, the mask builder, a fresh
`DynamicCache` and ~30 `nn.Module` calls per layer, against ~0.5 ms of tensor ops. The engine's
`_decode_rows` calls `LeanDecoder` instead when the model qualifies (`lean_decoder`); prefill
stays on the model's own forward.

The math is the same op for op (transformers 5 `modeling_qwen2.py` and
`integrations/sdpa_attention.py`): RMSNorm in fp32, q/k/v projections with bias, rotary
embeddings from the model's own `rotary_emb`, the new K/V appended to each layer's cache
(`torch.cat` on the sequence dim, as `DynamicLayer.update`), SDPA with the padding mask and the
query heads packed onto their key/value heads (transformers' `pack_gqa` for one query token), o_proj,
residual, RMSNorm, SiLU-gated MLP, final norm, lm_head on the last position; a projection that
carries a LoRA adapter runs its PEFT layer (`linear`). The weights are read
from the modules on every call, so parameters the HybridEngine rebinds or refills between
phases are always the current ones. tests/unit/inference/test_engine_decode.py checks the logits
and caches against the model's forward over a left-padded batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection: `F.linear` on the module's weights, or the module itself when it carries a
    LoRA adapter (PEFT's layer adds its `scaling · B(A(x))`; `inference/peft_adapter.py`)."""
    if hasattr(module, "lora_A"):
        return module(x)
    return F.linear(x, module.weight, module.bias)


def lean_decoder(model: torch.nn.Module) -> LeanDecoder | None:
    """A `LeanDecoder` for `model` if it is a plain (not tensor-parallel) Qwen2 causal LM with full
    attention, SiLU MLPs and no extra attention features; None otherwise (use the model's forward)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != "qwen2":
        return None
    if type(model).__name__ != "Qwen2ForCausalLM" or not hasattr(model, "lm_head"):
        return None
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    if any(hasattr(p, "to_local") for p in model.parameters()):  # DTensor shards: TP needs its collectives
        return None
    return LeanDecoder(model)


class LeanDecoder:
    """One decode forward of a Qwen2 model over a left-padded batch with per-layer K/V caches."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim**-0.5
        self.eps = float(config.rms_norm_eps)

    def _norm(self, norm: Any, h: torch.Tensor) -> torch.Tensor:
        """Qwen2RMSNorm (one fused op; in fp32 the same values as transformers' five)."""
        if h.dtype != torch.float32:
            return norm.weight * F.rms_norm(h.float(), h.shape[-1:], None, self.eps).to(h.dtype)
        return F.rms_norm(h, h.shape[-1:], norm.weight, self.eps)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`x * cos + rotate_half(x) * sin`, with rotate_half's negation folded into `signed_sin`
        (the first half of sin negated; exact in IEEE arithmetic)."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def __call__(
        self,
        last: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """`last` [B] token ids, `mask` [B, L+1] (1 = real token, the new one included), `positions`
        [B], caches [B, Hkv, L, D] per layer -> (fp32 logits [B, V], the caches with the new K/V)."""
        b = last.shape[0]
        h = F.embedding(last, self.base.embed_tokens.weight)  # [B, hidden]
        cos, sin = self.base.rotary_emb(h, positions[:, None])  # [B, 1, D]
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over [B, Hkv, groups, D]
        attend = mask.bool()[:, None, None, :]  # [B, 1, 1, L+1]
        new_keys, new_values = [], []
        for layer, k_cache, v_cache in zip(self.layers, keys, values, strict=True):
            attn = layer.self_attn
            x = self._norm(layer.input_layernorm, h)
            q = linear(attn.q_proj, x).view(b, self.kv_heads, self.groups, self.head_dim)
            k = linear(attn.k_proj, x).view(b, self.kv_heads, 1, self.head_dim)
            v = linear(attn.v_proj, x).view(b, self.kv_heads, 1, self.head_dim)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_cache = torch.cat([k_cache, k], dim=2)
            v_cache = torch.cat([v_cache, v], dim=2)
            new_keys.append(k_cache)
            new_values.append(v_cache)
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=attend, scale=self.scaling)
            h = h + linear(attn.o_proj, out.reshape(b, -1))
            mlp = layer.mlp
            x = self._norm(layer.post_attention_layernorm, h)
            gate = F.silu(linear(mlp.gate_proj, x))
            up = linear(mlp.up_proj, x)
            h = h + linear(mlp.down_proj, gate * up)
        h = self._norm(self.base.norm, h)
        head = self.model.lm_head
        return linear(head, h).float(), new_keys, new_values
