"""The TP plan of the Qwen2 presets: which dim each parameter splits, and the errors for degrees
the model's heads do not allow."""

from __future__ import annotations

import pytest


def _meta_model(preset: str = "tiny"):
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.hybrid.procs import preset_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(preset_config(preset))


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


def test_reshard_refuses_the_layouts_it_does_not_run():
    from agentrl.hybrid.layout import GenLayout, HybridLayout, TrainLayout
    from agentrl.hybrid.reshard import _check_supported

    _check_supported(HybridLayout(TrainLayout(t=2, d=2), GenLayout(tg=2, dg=2)))
    _check_supported(HybridLayout(TrainLayout(t=2, d=2), GenLayout(tg=1, dg=4)))
    _check_supported(HybridLayout(TrainLayout(t=2, d=1, fsdp=False), GenLayout(tg=1, dg=2)))  # Megatron TP
    with pytest.raises(NotImplementedError, match="pipeline stages and replicated data parallel are not"):
        _check_supported(HybridLayout(TrainLayout(p=2, t=1, d=2), GenLayout(pg=2, tg=1, dg=2)))
    with pytest.raises(NotImplementedError, match="Megatron TP over every rank"):  # Megatron TP x DP 2
        _check_supported(HybridLayout(TrainLayout(t=2, d=2, fsdp=False), GenLayout(tg=2, dg=1)))
    with pytest.raises(NotImplementedError, match="generation tg=4 above the training t=2"):
        _check_supported(HybridLayout(TrainLayout(t=2, d=2), GenLayout(tg=4, dg=1)))
    # t=3, d=2, tg=2: the layout is valid, but one generation TP group is ranks (3, 2) in that
    # order, which torch's process group would hold as (2, 3)
    odd = HybridLayout(TrainLayout(t=3, d=2), GenLayout(tg=2, dg=3))
    assert any(row != sorted(row) for row in odd.gen_mesh())
    with pytest.raises(NotImplementedError, match="generation tg=2 does not divide the training t=3"):
        _check_supported(odd)
    for t, d, tg in ((2, 2, 2), (2, 2, 1), (4, 2, 2), (4, 1, 2), (2, 1, 2)):  # tg | t: rows in rank order
        rows = HybridLayout(TrainLayout(t=t, d=d), GenLayout(tg=tg, dg=t * d // tg)).gen_mesh()
        assert all(row == sorted(row) for row in rows), (t, d, tg)


def test_reorder_puts_blocks_in_layout_order():
    import torch

    from agentrl.hybrid.gather import reorder

    for order in ([0, 2, 1, 3], [1, 2, 3, 0], [3, 2, 1, 0], [0, 1, 2, 3]):
        want = torch.arange(4 * 3 * 2, dtype=torch.float32).view(12, 2)  # 4 blocks of 3 rows
        blocks = want.view(4, 3, 2)
        buffer = torch.cat([blocks[j] for j in order])  # block q holds the data of block order[q]
        reorder(buffer, order)
        assert torch.equal(buffer, want), order


def test_buckets_keep_large_parameters_in_place_and_cap_each_bucket():
    import torch

    from agentrl.hybrid.gather import GenSlot, plan_buckets

    def slot(name: str, numel: int, group: str = "micro") -> GenSlot:
        return GenSlot(name, "col", torch.empty(numel), 4 * numel, ((0, numel),), False, group)

    slots = [slot("a", 100), slot("big", 5000), slot("b", 200), slot("n", 8, "fsdp"), slot("c", 900)]
    in_place, buckets = plan_buckets(slots, {"micro": 2, "fsdp": 4}, bucket_bytes=4 * 1000)
    assert [s.name for s in in_place] == ["big"]
    assert [[s.name for s in b.slots] for b in buckets] == [["a", "b"], ["n"], ["c"]]
    assert [b.offsets for b in buckets] == [[0, 50], [0], [0]]  # one rank's blocks: numel / group size
    assert [b.numel for b in buckets] == [150, 2, 450]
