"""The engine on a module it is handed, and its buffers released and rebuilt between phases.

Real model, real engine thread: generate, release (KV cache and parameter storage freed), rebuild
on different weights, generate again; the engine's behaviour log-probs must equal a fresh model's
forward under the weights it was rebuilt with (greedy, so the tokens are the argmax path).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.hybrid.tp import empty_model
from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams

PROMPTS = [[11, 25, 37, 49], [101, 7, 300, 12, 5, 66], [900, 3]]


def _generate(engine: Engine, prompts: list[list[int]], n: int = 6) -> list[Request]:
    done: dict[str, Request] = {}
    event = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == len(prompts):
            event.set()

    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        engine.submit(Request(f"r{i}", ids, params, on_done))
    assert event.wait(60), "generation did not finish"
    return [done[f"r{i}"] for i in range(len(prompts))]


def _reference_logprobs(model: torch.nn.Module, req: Request) -> list[float]:
    ids = torch.tensor([req.input_ids + req.output_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    start = len(req.input_ids)
    return [float(logp[start - 1 + j, t]) for j, t in enumerate(req.output_ids)]


def _check(model: torch.nn.Module, reqs: list[Request]) -> None:
    for req in reqs:
        assert len(req.output_ids) == 6
        ref = _reference_logprobs(model, req)
        assert max(abs(a - b) for a, b in zip(req.logprobs, ref, strict=True)) < 1e-5


@pytest.fixture
def shifted(tiny_model: Path) -> torch.nn.Module:
    """The tiny model with every weight moved, so a stale buffer would show in the log-probs."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_engine_serves_the_module_it_is_given_then_releases_and_rebuilds(tiny_model: Path, shifted):
    config = AutoConfig.from_pretrained(str(tiny_model))
    module = empty_model(config, torch.device("cpu"), torch.float32)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    engine = Engine(str(tiny_model), model=module, max_batch_size=8)
    assert engine.model is module  # served as it is: no second from_pretrained copy
    engine.load_weights(dict(original.named_parameters()), "1")
    engine.start()
    try:
        _check(original, _generate(engine, PROMPTS))

        freed = engine.call(engine.release).result(timeout=30)
        params = sum(p.numel() * p.element_size() for p in original.parameters())
        assert freed == params  # every parameter's storage, tied embeddings counted once
        assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
        assert engine.released and engine._batch is None
        with pytest.raises(ValueError, match="needs the weights"):
            engine.call(engine.rebuild).result(timeout=30)
        with pytest.raises(RuntimeError, match="rebuild"):
            engine.call(lambda: engine.load_weights({}, None)).result(timeout=30)

        weights = dict(shifted.named_parameters())
        engine.call(lambda: engine.rebuild(weights, "2")).result(timeout=30)
        assert not engine.released and engine.weight_version == "2"
        reqs = _generate(engine, PROMPTS)
        _check(shifted, reqs)
        assert all(r.weight_version == "2" for r in reqs)
    finally:
        engine.stop()


def test_release_refuses_while_requests_run(tiny_model: Path):
    engine = Engine(str(tiny_model), max_batch_size=8)
    engine.submit(Request("x", [5, 6, 7], SamplingParams(max_new_tokens=4), lambda r: None))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release()


def test_rebuild_on_cpu_needs_every_parameter(tiny_model: Path):
    engine = Engine(str(tiny_model), max_batch_size=8)
    names = [n for n, _ in engine.model.named_parameters()]
    engine.release()
    partial = {n: p for n, p in AutoModelForCausalLM.from_pretrained(str(tiny_model)).named_parameters()}
    partial.pop(names[-1])
    with pytest.raises(ValueError, match="lack parameters"):
        engine.rebuild(partial)


def test_offload_keeps_every_view_of_a_shared_storage():
    """The offload copies a parameter's whole storage: a second parameter viewing the same storage
    at another offset (packed weights) comes back too, not only the view the storage was found by."""
    from agentrl.inference.buffers import offload_storage, restore_storage

    flat = torch.arange(24, dtype=torch.float32)
    first, second = flat[:8].view(2, 4), flat[8:].view(4, 4)  # one storage, two parameters
    expected = (first.clone(), second.clone())
    copy = offload_storage(first)
    first.untyped_storage().resize_(0)  # what release() does after the copy
    restore_storage(first, copy)
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
