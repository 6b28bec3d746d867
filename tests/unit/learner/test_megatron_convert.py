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
        convert.hf_names("decoder.layers.0.mlp.linear_fc3.weight", offset, SHAPE)


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


MOE = convert.Shape(heads=4, groups=2, head_dim=3, hidden=8, ffn=6, layers=3, vocab=16, tied=True, qkv_bias=True,
                    qk_norm=False, experts=3, top_k=2, moe_ffn=4, shared_ffn=6, norm_topk=True,
                    sparse=(False, True, True))  # fmt: skip


def test_moe_layers_map_to_the_hf_router_experts_and_shared_expert():
    layer = lambda i: i  # noqa: E731
    names = {
        "decoder.layers.1.mlp.router.weight": ("model.layers.1.mlp.gate.weight",),
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight": (
            "model.layers.1.mlp.experts.2.gate_proj.weight",
            "model.layers.1.mlp.experts.2.up_proj.weight",
        ),
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight": (
            "model.layers.1.mlp.experts.0.down_proj.weight",
        ),
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight": (
            "model.layers.2.mlp.shared_expert.gate_proj.weight",
            "model.layers.2.mlp.shared_expert.up_proj.weight",
        ),
        "decoder.layers.2.mlp.shared_experts.gate_weight": ("model.layers.2.mlp.shared_expert_gate.weight",),
    }
    for name, hf in names.items():
        assert convert.hf_names(name, layer, MOE) == hf
    # the routed experts are whole on every TP rank; the shared expert is split as a dense MLP
    assert convert.partition_dim("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight") is None
    assert convert.partition_dim("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight") is None
    assert convert.partition_dim("decoder.layers.1.mlp.router.weight") is None
    assert convert.partition_dim("decoder.layers.2.mlp.shared_experts.linear_fc1.weight") == 0
    assert convert.partition_dim("decoder.layers.2.mlp.shared_experts.linear_fc2.weight") == 1
    # an expert's fc1 is [gate; up] whatever the TP size; the shared expert's follows the TP ranks
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert torch.equal(convert.to_megatron(expert, [gate, up], MOE, tp=2), torch.cat([gate, up]))
    shared = "decoder.layers.2.mlp.shared_experts.linear_fc1.weight"
    assert torch.equal(convert.to_megatron(shared, [gate, up], MOE, tp=2), convert.stack_fc1(gate, up, 2))
    for name in (expert, shared):
        back = convert.to_hf(name, convert.to_megatron(name, [gate, up], MOE, 2), MOE, 2)
        assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_experts_fuse_as_transformers_holds_them_and_cut_back():
    per_expert = {
        f"model.layers.1.mlp.experts.{e}.{p}.weight": torch.randn(8, 4)
        if p == "down_proj"
        else torch.randn(4, 8)
        for e in range(3)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    other = ("model.layers.1.mlp.gate.weight", torch.randn(3, 8))
    fused = dict(convert.fuse_experts(iter([other, *per_expert.items()]), experts=3))
    assert list(fused) == ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                           "model.layers.1.mlp.experts.down_proj"]  # fmt: skip
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (3, 8, 8)
    assert torch.equal(fused["model.layers.1.mlp.experts.gate_up_proj"][1, 4:], per_expert[
        "model.layers.1.mlp.experts.1.up_proj.weight"])  # fmt: skip
    for name, tensor in per_expert.items():  # and a fused checkpoint gives each expert's tensor back
        assert torch.equal(convert.expert_of_fused(name, fused.__getitem__), tensor)
    assert convert.expert_of_fused("model.layers.1.mlp.gate.weight", fused.__getitem__) is None
    with pytest.raises(ValueError, match="experts missing"):
        list(convert.fuse_experts(iter(list(per_expert.items())[:-1]), experts=3))


def test_moe_shapes_follow_the_hf_configs_sparse_layers():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    qwen2 = convert.shape_of(Qwen2MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, num_experts=4,
                                            num_experts_per_tok=2, norm_topk_prob=False))  # fmt: skip
    assert qwen2.sparse == (False, True, False, True) and qwen2.qkv_bias and not qwen2.qk_norm
    assert qwen2.shared_ffn > 0 and not qwen2.norm_topk
    assert [qwen2.moe_index(i) for i in (1, 3)] == [0, 1]  # the layer axis of recorded routing
    qwen3 = convert.shape_of(Qwen3MoeConfig(num_hidden_layers=3, mlp_only_layers=[0], num_experts=8,
                                            num_experts_per_tok=2, norm_topk_prob=True))  # fmt: skip
    assert qwen3.sparse == (False, True, True) and qwen3.qk_norm and qwen3.shared_ffn == 0 and qwen3.norm_topk


def test_moe_router_settings_reproduce_transformers_top_k():
    """norm_topk_prob: top-k of the logits, softmax over the k (= the renormalised softmax); without
    it the softmax over all experts, then top-k (`moe_router_pre_softmax`). No auxiliary loss."""
    on = convert.moe_config(MOE, tp=2, pp=1)
    off = convert.moe_config(convert.dataclasses.replace(MOE, norm_topk=False, shared_ffn=0), tp=2, pp=1)
    assert on["moe_router_score_function"] == "softmax" and not on["moe_router_pre_softmax"]
    assert off["moe_router_pre_softmax"] and off["moe_shared_expert_intermediate_size"] is None
    assert on["moe_router_load_balancing_type"] == "none" and on["moe_aux_loss_coeff"] == 0.0
    assert on["moe_shared_expert_gate"] and on["expert_tensor_parallel_size"] == 1
    assert on["moe_layer_freq"] == [0, 1, 1]
    with pytest.raises(ValueError, match="shared expert's width 6"):
        convert.moe_config(MOE, tp=4, pp=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"all-to-all token dispatcher .* needs CUDA"):
            convert.moe_config(MOE, tp=1, pp=2)
