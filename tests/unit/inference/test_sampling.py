"""Sampling: truncation sets and the log-prob of the distribution actually sampled from."""

from __future__ import annotations

import torch

from agentrl.inference.sampling import SamplingParams, sample


def _logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_temperature_one_logprob_is_log_softmax():
    logits = _logits()
    tokens, lp = sample(logits, [SamplingParams()] * 4, [None] * 4)
    ref = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=1e-6)


def test_tempered_logprob_uses_scaled_distribution():
    logits = _logits()
    tokens, lp = sample(logits, [SamplingParams(temperature=0.5)] * 4, [None] * 4)
    ref = (logits / 0.5).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=1e-5)


def test_top_k_only_samples_top_tokens_and_renormalises():
    logits = _logits(1) / 3
    top = set(logits[0].topk(3).indices.tolist())
    gens = [torch.Generator().manual_seed(s) for s in range(40)]
    seen = set()
    for g in gens:
        tok, lp = sample(logits, [SamplingParams(top_k=3, sampling_seed=1)], [g])
        seen.add(int(tok))
        kept = logits[0, sorted(top)]
        ref = kept.log_softmax(-1)[sorted(top).index(int(tok))]
        assert abs(float(lp) - float(ref)) < 1e-5
    assert seen <= top and len(seen) > 1


def test_top_p_keeps_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for s in range(30):
        tok, _ = sample(logits, [SamplingParams(top_p=0.7)], [torch.Generator().manual_seed(s)])
        assert int(tok) in (0, 1)


def test_greedy_rows_mix_with_sampled_rows():
    logits = _logits()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(),
    ]
    tokens, lp = sample(logits, params, [None] * 4)
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())
    assert abs(float(lp[0]) - float(logits[0].log_softmax(-1).max())) < 1e-6


def test_seeded_rows_are_reproducible():
    logits = _logits(2)
    a, _ = sample(logits, [SamplingParams()] * 2, [torch.Generator().manual_seed(7)] * 2)
    b, _ = sample(logits, [SamplingParams()] * 2, [torch.Generator().manual_seed(7)] * 2)
    assert a.tolist() == b.tolist()


def test_draws_follow_the_distribution_seeded_or_not():
    """The inverse-transform draw is a categorical sample: frequencies of 40,000 draws, seeded per
    row and from torch's generator, within 0.01 of the probabilities (deterministic seeds)."""
    from agentrl.inference.sampling import draw

    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    torch.manual_seed(0)
    rows = 40
    gens = [torch.Generator().manual_seed(s) for s in range(rows)]
    for generators in (gens, [None] * rows):
        counts = torch.zeros(5)
        for _ in range(1000):
            tokens = draw(probs.expand(rows, 5), generators)
            counts += torch.bincount(tokens, minlength=5)
        freq = counts / counts.sum()
        assert freq[3] == 0
        assert (freq - probs).abs().max() < 0.01, freq


def test_a_draw_at_the_top_of_the_unit_interval_never_lands_on_a_zero_mass_token():
    from agentrl.inference.sampling import inverse_cdf

    probs = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 1e-30, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.7]])
    for top in (1 - 2**-24, 1.0):  # torch.rand's largest fp32 value; the closed end, past it
        assert inverse_cdf(probs, torch.full((3, 1), top)).tolist() == [2, 1, 4]
    assert inverse_cdf(probs, torch.zeros(3, 1)).tolist() == [0, 1, 4]


def test_a_seeded_rows_tokens_do_not_depend_on_its_batch():
    """A seeded request's stream gives one draw per token: alone or beside other rows, seeded or
    not, the same tokens."""
    logits = _logits(3)
    alone, _ = sample(logits[1:2], [SamplingParams()], [torch.Generator().manual_seed(5)])
    mixed, _ = sample(
        logits, [SamplingParams()] * 3, [None, torch.Generator().manual_seed(5), torch.Generator()]
    )
    assert int(alone) == int(mixed[1])
