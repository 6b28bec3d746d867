"""The lean Qwen2 decode step (agentrl/inference/decode.py) against the model's own forward."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from agentrl.inference.decode import LeanDecoder, lean_decoder
from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def hf_engine(tiny_model: Path) -> Engine:
    """An engine whose `_forward` is transformers' forward (the reference); never started."""
    return Engine(str(tiny_model), lean_decode=False)


def test_lean_step_equals_the_model_forward_over_a_left_padded_batch(hf_engine: Engine):
    """Six decode steps over five rows with 0..8 columns of left padding: logits and every layer's
    K/V cache equal transformers' (fp32, to 1e-6; they are equal op for op)."""
    lean = lean_decoder(hf_engine.model)
    assert isinstance(lean, LeanDecoder)
    gen = torch.Generator().manual_seed(0)
    rows, length = 5, 12
    ids = torch.randint(10, 1000, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : 2 * i] = 0
        ids[i, : 2 * i] = 0
    with torch.no_grad():
        _, keys, values = hf_engine._forward(ids, mask, (mask.cumsum(1) - 1).clamp(min=0))
        ref_k, ref_v, k, v = keys, values, keys, values
        positions, last = mask.sum(1), torch.randint(10, 1000, (rows,), generator=gen)
        for _ in range(6):
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], dim=1)
            ref, ref_k, ref_v = hf_engine._forward(last[:, None], mask, positions[:, None], ref_k, ref_v)
            logits, k, v = lean(last, mask, positions, k, v)
            assert logits.dtype == torch.float32 and logits.shape == ref.shape
            assert (logits - ref).abs().max().item() <= 1e-6
            for a, b in zip(k + v, ref_k + ref_v, strict=True):
                assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-6
            positions, last = positions + 1, ref.argmax(-1)


def test_models_it_does_not_cover_keep_their_own_forward():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

    from agentrl.tiny_model import PRESETS, qwen2_config

    shape = PRESETS["tiny"]
    sliding = Qwen2ForCausalLM(
        qwen2_config(shape, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    )
    assert lean_decoder(sliding) is None
    gelu = Qwen2ForCausalLM(qwen2_config(shape, hidden_act="gelu"))
    assert lean_decoder(gelu) is None
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    assert lean_decoder(llama) is None
    assert lean_decoder(Qwen2ForCausalLM(qwen2_config(shape))) is not None


def _run(engine: Engine, seeded: bool) -> dict[str, Request]:
    """Six requests queued before the engine starts, so both engines batch them alike."""
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == 6:
            finished.set()

    for i in range(6):
        params = SamplingParams(max_new_tokens=5 + 2 * i, ignore_eos=True, temperature=0.0 if i == 5 else 1.0,
                                top_k=20 if i == 4 else -1, sampling_seed=100 + i if seeded else None)  # fmt: skip
        engine.submit(
            Request(f"r{i}", [(13 * i + 7 * k) % 900 + 10 for k in range(2 + 3 * i)], params, on_done)
        )
    engine.start()
    assert finished.wait(60), f"only {len(done)}/6 finished"
    return done


def test_engine_output_is_the_same_with_and_without_the_lean_step(tiny_model: Path):
    """Seeded requests of mixed lengths, temperatures and truncation: the same tokens, and
    log-probs within 1e-6, whichever forward the decode steps take."""
    out = {}
    for lean in (False, True):
        engine = Engine(str(tiny_model), max_batch_size=8, lean_decode=lean)
        assert (engine._lean is not None) == lean
        try:
            out[lean] = _run(engine, seeded=True)
        finally:
            engine.stop()
    for rid, req in out[False].items():
        other = out[True][rid]
        assert other.output_ids == req.output_ids, rid
        assert torch.allclose(torch.tensor(other.logprobs), torch.tensor(req.logprobs), atol=1e-6), rid
