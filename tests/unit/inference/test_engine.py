"""The batched decode loop, in process: log-probs vs a fresh forward, batching, stops, abort, weights."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model: Path):
    eng = Engine(str(tiny_model), max_batch_size=8)
    eng.start()
    yield eng
    eng.stop()


class Collector:
    def __init__(self, n: int) -> None:
        self.n, self.done, self.event = n, {}, threading.Event()

    def __call__(self, req: Request) -> None:
        self.done[req.rid] = req
        if len(self.done) >= self.n:
            self.event.set()

    def wait(self) -> dict[str, Request]:
        assert self.event.wait(60), f"only {len(self.done)}/{self.n} finished"
        return self.done


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * k) % 900 + 10 for k in range(3 + (i * 5) % 9)]


def test_logprobs_match_fresh_forward_with_staggered_joins(engine: Engine):
    """Requests join a running batch between steps (left-padded cache merge); every log-prob must
    equal a fresh full forward pass of prompt + output at temperature 1 (fp32) within 1e-4."""
    col = Collector(12)
    for i in range(12):  # more than max_batch_size, arriving while others decode
        engine.submit(
            Request(f"lp{i}", _prompt(i), SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True), col)
        )
        time.sleep(0.01 * (i % 3))
    done = col.wait()
    for req in done.values():
        assert req.finish_reason == {"type": "length", "length": len(req.output_ids)}
        ids = torch.tensor([req.input_ids + req.output_ids])
        with torch.no_grad():
            logp = engine.model(input_ids=ids).logits[0].float().log_softmax(-1)
        p = len(req.input_ids)
        ref = logp[p - 1 : -1].gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(req.logprobs), ref, atol=1e-4), req.rid


def test_greedy_batched_equals_one_at_a_time(engine: Engine):
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    solo = {}
    for i in range(4):
        col = Collector(1)
        engine.submit(Request(f"solo{i}", _prompt(i), params, col))
        solo[i] = col.wait()[f"solo{i}"].output_ids
    col = Collector(4)
    for i in range(4):
        engine.submit(Request(f"batch{i}", _prompt(i), params, col))
    done = col.wait()
    assert {i: done[f"batch{i}"].output_ids for i in range(4)} == solo


def test_stop_token_and_length(engine: Engine):
    col = Collector(1)
    engine.submit(
        Request("greedy", _prompt(1), SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True), col)
    )
    out = col.wait()["greedy"].output_ids
    stop_at = out[3]
    col = Collector(2)
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, stop_token_ids={stop_at})
    engine.submit(Request("stop", _prompt(1), p, col))
    engine.submit(Request("zero", _prompt(1), SamplingParams(max_new_tokens=0), col))
    done = col.wait()
    first = out.index(stop_at)
    assert done["stop"].output_ids == out[: first + 1]
    assert done["stop"].finish_reason == {"type": "stop", "matched": stop_at}
    assert done["zero"].output_ids == [] and done["zero"].finish_reason["type"] == "length"


def test_abort_and_pause_return_partial_output(engine: Engine):
    col = Collector(3)
    long = SamplingParams(max_new_tokens=3000, ignore_eos=True)
    engine.submit(Request("a", _prompt(2), long, col))
    engine.submit(Request("b", _prompt(3), long, col))
    while engine.num_running < 2:
        time.sleep(0.01)
    time.sleep(0.1)
    assert engine.call(lambda: engine.abort(rid="a")).result(10) == 1
    engine.call(engine.pause).result(10)
    engine.submit(Request("held", _prompt(4), SamplingParams(max_new_tokens=2), col))
    time.sleep(0.2)
    assert "held" not in col.done  # paused: new requests wait
    engine.call(engine.resume).result(10)
    done = col.wait()
    for rid in ("a", "b"):
        assert done[rid].finish_reason["type"] == "abort"
        assert 0 < len(done[rid].output_ids) < 3000 and len(done[rid].logprobs) == len(done[rid].output_ids)
    assert len(done["held"].output_ids) == 2


def test_mismatched_weights_are_rejected_and_change_nothing(engine: Engine):
    name = "model.norm.weight"
    before = engine.model.state_dict()[name].clone()
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.call(lambda: engine.load_weights({name: torch.zeros(3)}, "9")).result(10)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.call(lambda: engine.load_weights({"nope": torch.zeros(3)}, "9")).result(10)
    assert torch.equal(engine.model.state_dict()[name], before) and engine.weight_version == "0"


def test_stop_string_ends_generation_where_it_first_appears(engine: Engine):
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    col = Collector(1)
    engine.submit(Request("free", _prompt(5), params, col))
    out = col.wait()["free"].output_ids
    tok = engine.tokenizer
    text = tok.decode(out[:6], skip_special_tokens=False)
    stop = text[-2:] if len(text) >= 2 else text
    col = Collector(1)
    p = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    engine.submit(Request("stopstr", _prompt(5), p, col))
    req = col.wait()["stopstr"]
    assert req.finish_reason == {"type": "stop", "matched": stop}
    assert stop in tok.decode(req.output_ids, skip_special_tokens=False)
    assert stop not in tok.decode(req.output_ids[:-1], skip_special_tokens=False)
    assert req.output_ids == out[: len(req.output_ids)] and len(req.output_ids) <= 6


def test_update_mid_request_reports_the_older_version(engine: Engine):
    col = Collector(2)
    engine.submit(Request("span", _prompt(6), SamplingParams(max_new_tokens=400, ignore_eos=True), col))
    while engine.num_running == 0:
        time.sleep(0.01)
    same = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.call(lambda: engine.load_weights(same, "5")).result(10)
    engine.submit(Request("after", _prompt(6), SamplingParams(max_new_tokens=2), col))
    done = col.wait()
    assert done["span"].weight_version == "0" and done["after"].weight_version == "5"
    engine.call(lambda: setattr(engine, "weight_version", "0")).result(10)
