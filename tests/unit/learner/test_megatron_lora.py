"""`megatron_lora` without a process group: which HF modules `target_modules` adapts (and what it
refuses, by name), the adapters' output laid out as the fused base layer's (q/k/v grouped per
key/value head as `megatron_convert.group_qkv`, gate/up stacked), and dropout's mask on a
row-parallel shard being the slice of the unsplit layer's. The TP collectives and the equivalence
with PEFT run in tests/integration/test_megatron_lora.py."""

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)

from agentrl.learner import megatron_convert as convert
from agentrl.learner.lora import LoraConfig
from agentrl.learner.megatron_lora import Adapter, ParallelLora, Switch, check_stages, targets

SHAPE = convert.Shape(heads=4, groups=2, head_dim=3, hidden=8, ffn=6, layers=2, vocab=32, tied=True,
                      qkv_bias=True, qk_norm=False)  # fmt: skip


def test_targets_follow_peft_matching():
    chosen = targets(LoraConfig(target_modules=["q_proj", "model.layers.1.mlp.down_proj"]), layers=2)
    assert chosen == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                      "model.layers.1.mlp.down_proj"}  # fmt: skip


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["q_proj", "qkv_proj"], "'qkv_proj' matches no Linear module"),
        (["lm_head"], "'lm_head' matches \\['lm_head'\\], which the Megatron backend cannot adapt"),
    ],
)
def test_unmappable_targets_are_refused_by_name(entries, message):
    with pytest.raises(ValueError, match=message):
        targets(LoraConfig(target_modules=entries), layers=2)


def test_modules_to_save_is_refused():
    with pytest.raises(ValueError, match="modules_to_save \\['lm_head'\\]"):
        targets(LoraConfig(modules_to_save=["lm_head"]), layers=2)


def test_every_pipeline_stage_needs_an_adapter():
    one_layer = targets(LoraConfig(target_modules=["model.layers.3.mlp.down_proj"]), layers=4)
    check_stages(one_layer, layers=4, pp=1)
    check_stages(targets(LoraConfig(target_modules=["q_proj"]), layers=4), layers=4, pp=2)
    with pytest.raises(ValueError, match="pipeline stage 0 \\(layers 0-1\\)"):
        check_stages(one_layer, layers=4, pp=2)


def _lora(layer: str, column: bool, shapes: dict, dropout: float = 0.0, tp: int = 1, rank: int = 0):
    cfg = LoraConfig(rank=2, alpha=6.0, dropout=dropout)
    torch.manual_seed(0)
    adapters = {n: Adapter(torch.randn(2, fan_in), torch.randn(fan_out, 2), column)
                for n, (fan_in, fan_out) in shapes.items()}  # fmt: skip
    return ParallelLora(layer, column, adapters, SHAPE, cfg, tp, rank, Switch())


def test_qkv_deltas_are_grouped_as_the_fused_layer():
    """Only q and v adapted: the delta equals x @ (the fused weight of B A per module, k zero)."""
    lora = _lora("self_attention.linear_qkv", True, {"q_proj": (8, 12), "v_proj": (8, 6)}).eval()
    x = torch.randn(5, 1, 8)
    w = {n: a.lora_B @ a.lora_A * 3.0 for n, a in lora.adapters.items()}
    fused = convert.group_qkv(w["q_proj"], torch.zeros(6, 8), w["v_proj"], SHAPE)
    torch.testing.assert_close(lora(x), x @ fused.t())


def test_fc1_deltas_are_stacked_as_the_fused_layer():
    lora = _lora("mlp.linear_fc1", True, {"gate_proj": (8, 6), "up_proj": (8, 6)}).eval()
    x = torch.randn(5, 1, 8)
    w = {n: a.lora_B @ a.lora_A * 3.0 for n, a in lora.adapters.items()}
    torch.testing.assert_close(lora(x), x @ convert.stack_fc1(w["gate_proj"], w["up_proj"], 1).t())


def test_row_parallel_dropout_is_the_slice_of_the_unsplit_mask():
    """Each TP rank's dropout keeps its slice of the mask one unsplit layer would draw from the
    same generator state; in eval mode nothing is dropped."""
    whole = _lora("mlp.linear_fc2", False, {"down_proj": (6, 8)}, dropout=0.5).train()
    x = torch.randn(5, 1, 6)
    torch.manual_seed(1)
    dropped = whole._drop(x)
    assert (dropped == 0).any() and not torch.equal(dropped, x)
    for rank in range(2):
        shard = _lora("mlp.linear_fc2", False, {"down_proj": (3, 8)}, dropout=0.5, tp=2, rank=rank).train()
        torch.manual_seed(1)
        torch.testing.assert_close(shard._drop(x.chunk(2, dim=-1)[rank]), dropped.chunk(2, dim=-1)[rank])
    assert torch.equal(whole.eval()._drop(x), x)
