"""The HF <-> Megatron weight layout (`learner/megatron_convert.py`) without processes: the
per-KV-group q/k/v interleave, the per-TP-rank gate/up stacking, both layer specs' norm names,
and the families it refuses. The models themselves are compared in
tests/integration/test_learner_megatron.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentrl.learner import megatron_convert as convert

SHAPE = convert.Shape(heads=4, groups=2, head_dim=3, hidden=8, ffn=6, layers=2, vocab=16, tied=True,
                      qkv_bias=True, qk_norm=False)  # fmt: skip


def test_qkv_rows_are_grouped_per_kv_head_and_round_trip():
    q, k, v = torch.randn(12, 8), torch.randn(6, 8), torch.randn(6, 8)
    qkv = convert.group_qkv(q, k, v, SHAPE)
    # group 0: query heads 0-1, key head 0, value head 0; then group 1
    expected = torch.cat([q[:6], k[:3], v[:3], q[6:], k[3:], v[3:]])
    assert torch.equal(qkv, expected)
    assert not torch.equal(qkv, torch.cat([q, k, v]))  # plain concatenation is another layout
    assert all(torch.equal(a, b) for a, b in zip(convert.ungroup_qkv(qkv, SHAPE), (q, k, v), strict=True))


def test_fc1_holds_each_tp_rank_gate_then_up_and_round_trips():
    gate, up = torch.arange(6.0)[:, None], 10 + torch.arange(6.0)[:, None]
    fc1 = convert.stack_fc1(gate, up, tp=2)
    assert fc1.squeeze(1).tolist() == [0, 1, 2, 10, 11, 12, 3, 4, 5, 13, 14, 15]
    back = convert.unstack_fc1(fc1, tp=2)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_local_and_transformer_engine_norm_names_map_to_the_same_hf_tensors():
    local = "decoder.layers.1.input_layernorm.weight"
    te = "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    offset = lambda i: i + 2  # noqa: E731 (the second pipeline stage's numbering)
    assert convert.hf_names(local, offset, SHAPE) == convert.hf_names(te, offset, SHAPE)
    assert convert.hf_names(te, offset, SHAPE) == ("model.layers.3.input_layernorm.weight",)
    assert convert.hf_names("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", offset, SHAPE) == (
        "model.layers.2.post_attention_layernorm.weight",
    )
    assert convert.hf_names("output_layer.weight", offset, SHAPE) == ("model.embed_tokens.weight",)
    with pytest.raises(KeyError, match="no Hugging Face name"):
        convert.hf_names("decoder.layers.0.mlp.router.weight", offset, SHAPE)


def test_partition_dims():
    assert convert.partition_dim("embedding.word_embeddings.weight") == 0
    assert convert.partition_dim("decoder.layers.0.self_attention.linear_qkv.bias") == 0
    assert convert.partition_dim("decoder.layers.0.mlp.linear_fc2.weight") == 1
    assert convert.partition_dim("decoder.layers.0.pre_mlp_layernorm.weight") is None


def test_uncovered_models_are_refused_with_the_alternative():
    hf = SimpleNamespace(model_type="gpt2", num_attention_heads=4, hidden_size=8)
    with pytest.raises(ValueError, match="fsdp2"):
        convert.shape_of(hf)
    yarn = SimpleNamespace(model_type="qwen2", hidden_act="silu", rope_parameters={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="rope scaling"):
        convert.shape_of(yarn)
