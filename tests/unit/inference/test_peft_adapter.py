"""The embedded engine serving a LoRA adapter (agentrl/inference/peft_adapter.py), with PEFT's own
`PeftModel` as the oracle: after `load_adapter` the engine's forward equals PEFT's, and its lean
decode steps give what its model forward gives; a malformed adapter is refused whole (version and
weights unchanged); full weights clear the adapter and refuse later ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from agentrl.inference.engine import Engine
from tests.unit.inference.test_engine_decode import _run

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
CONFIG = {"name": "agentrl-lora-v3", "r": 4, "lora_alpha": 8.0, "target_modules": TARGETS}


def peft_oracle(tiny_model: Path, seed: int):
    """A PeftModel of the tiny model with random A and B, and its adapter as PEFT saves it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


def logits(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """The engine's prefill forward: the last position's fp32 logits [B, V]."""
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out, _, _ = engine._forward(ids, mask, (mask.cumsum(1) - 1))
    return out.float()


def test_engine_serves_the_peft_forward_and_lean_decode_applies_the_adapter(tiny_model: Path):
    oracle, tensors = peft_oracle(tiny_model, seed=1)
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in tensors)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11]])
    out = {}
    for lean in (False, True):
        engine = Engine(str(tiny_model), max_batch_size=8, lean_decode=lean)
        base = logits(engine, ids)
        engine.load_adapter(tensors, CONFIG, "3")
        assert engine.weight_version == "3" and engine.adapter_name == "agentrl-lora-v3"
        served = logits(engine, ids)
        with torch.no_grad():
            expected = oracle(input_ids=ids).logits.float()
        torch.testing.assert_close(served, expected[:, -1], rtol=0, atol=1e-5)  # last position's logits
        assert (served - base).abs().max() > 1e-3  # the adapter changes what is served
        try:
            out[lean] = _run(engine, seeded=True)
        finally:
            engine.stop()
    for rid, req in out[False].items():  # decode steps through the lean step apply the adapter too
        other = out[True][rid]
        assert other.output_ids == req.output_ids, rid
        assert torch.allclose(torch.tensor(other.logprobs), torch.tensor(req.logprobs), atol=1e-5), rid


def test_a_malformed_adapter_is_refused_whole(tiny_model: Path):
    engine = Engine(str(tiny_model), lean_decode=False)
    _, tensors = peft_oracle(tiny_model, seed=2)
    engine.load_adapter(tensors, CONFIG, "1")
    _, newer = peft_oracle(tiny_model, seed=3)
    ids = torch.tensor([[5, 17, 42, 99]])
    before = logits(engine, ids)

    name = next(n for n in newer if ".lora_A." in n)
    bad_shape = {**newer, name: torch.zeros(8, newer[name].shape[1])}
    with pytest.raises(ValueError, match="expected"):
        engine.load_adapter(bad_shape, CONFIG, "2")
    missing = {n: t for n, t in newer.items() if "layers.0.self_attn.q_proj" not in n}
    with pytest.raises(ValueError, match="lacks"):
        engine.load_adapter(missing, CONFIG, "2")
    with pytest.raises(ValueError, match="not in target_modules"):
        engine.load_adapter(newer, {**CONFIG, "target_modules": ["q_proj"]}, "2")
    with pytest.raises(ValueError, match="differ from the served adapter"):
        engine.load_adapter({n: t[:2] if ".lora_A." in n else t[:, :2] for n, t in newer.items()},
                            {**CONFIG, "r": 2}, "2")  # fmt: skip
    assert engine.weight_version == "1"
    torch.testing.assert_close(logits(engine, ids), before, rtol=0, atol=0)

    # full weights replace the base: the adapter is cleared, and adapters are refused from then on
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine.load_weights(dict(plain.named_parameters()), "5")
    assert engine.adapter_name is None
    fresh = Engine(str(tiny_model), lean_decode=False)
    torch.testing.assert_close(logits(engine, ids), logits(fresh, ids), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="replaced by a full-weight push"):
        engine.load_adapter(newer, CONFIG, "6")
