"""The TP plan of the Qwen2 presets: which dim each parameter splits, and the errors for degrees
the model's heads do not allow."""

from __future__ import annotations

import pytest


def _meta_model(preset: str = "tiny"):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agentrl.tiny_model import PRESETS

    s = PRESETS[preset]
    config = Qwen2Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_plan_dims_by_parameter():
    from agentrl.hybrid.tp import fsdp_shard_placement, param_specs, tp_dim, tp_plan

    model = _meta_model()
    dims = {s.name: s.tp_dim for s in param_specs(model)}
    assert "lm_head.weight" not in dims  # tied: one parameter, under the embedding's name
    assert dims["model.embed_tokens.weight"] == 0
    assert dims["model.layers.1.self_attn.q_proj.bias"] == 0
    assert dims["model.layers.1.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.0.mlp.down_proj.weight"] == 1
    assert dims["model.layers.0.mlp.gate_proj.weight"] == 0
    assert dims["model.layers.0.input_layernorm.weight"] is None and tp_dim("model.norm.weight") is None
    placement = fsdp_shard_placement(model)
    assert placement(model.model.layers[0].mlp.down_proj.weight).dim == 1
    assert placement(model.model.norm.weight).dim == 0
    plan = tp_plan(model)
    assert type(plan["model.layers.0.self_attn.o_proj"]).__name__ == "RowwiseParallel"
    assert type(plan["model.layers.1.mlp.up_proj"]).__name__ == "ColwiseParallel"


def test_pipeline_stages_of_specs():
    from agentrl.hybrid.tp import param_specs

    specs = {s.name: s.stage for s in param_specs(_meta_model("small"), p=2)}
    assert specs["model.layers.3.mlp.up_proj.weight"] == 0 and specs["model.layers.4.mlp.up_proj.weight"] == 1
    assert specs["model.norm.weight"] == 1


def test_tp_degree_the_heads_do_not_allow():
    from agentrl.hybrid.tp import check_tp_degree

    config = _meta_model("small").config  # 6 heads, 2 kv heads
    check_tp_degree(config, 2)
    with pytest.raises(
        ValueError, match=r"tg=4 does not divide num_attention_heads=6, num_key_value_heads=2"
    ):
        check_tp_degree(config, 4)
