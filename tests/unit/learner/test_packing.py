"""Packing: bins respect the budget, ranks are balanced and in step, and a packed micro-batch
gives the same per-token log-probs, loss and gradients as the padded layout (so the model's
attention over a packed row is block-diagonal)."""

import numpy as np
import pytest
import torch

from agentrl.config import LossConfig
from agentrl.learner.data import prepare_batch
from agentrl.learner.hf_model import forward_logprobs
from agentrl.learner.packing import (
    balance_across_ranks,
    first_fit_decreasing,
    non_padding_fraction,
    packed_microbatch,
    padded_microbatch,
    padded_plan,
    plan_microbatches,
)
from agentrl.learner.train_step import microbatch_loss
from tests.unit.learner.source import make_groups


def test_first_fit_decreasing_respects_budget():
    lengths = [50, 10, 30, 70, 20, 20, 90, 5]
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) == 3  # 295 tokens need at least 3 bins of 100
    assert first_fit_decreasing([150, 10], 100) == [[0], [1]]  # over-long item gets its own bin


def test_balance_across_ranks_by_tokens():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5]
    ranks = balance_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert sorted(loads) == [140, 170]  # {90, 80} cannot be split; everything else goes to the other rank
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))


def _samples(n_groups=3, seed=0, **kw):
    groups = make_groups(n_groups, seed=seed, **kw)
    return prepare_batch(
        groups, advantage="grpo", loss_agg="token_mean", vocab_size=1024, learner_version=0
    ).mini_batches[0]


def test_every_rank_gets_the_same_number_of_microbatches():
    samples = _samples(4, min_len=5, max_len=60)
    plans = [plan_microbatches(samples, 64, world_size=3, rank=r) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    assert sum(mb.real_tokens for p in plans for mb in p) == sum(len(s) for s in samples)
    for p in plans:
        for mb in p:
            assert mb.input_ids.shape[1] % 8 == 0


def test_packed_positions_restart_and_padding_is_masked():
    samples = _samples(1)[:3]
    mb = packed_microbatch(samples, pad_multiple=16)
    pos = mb.position_ids[0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    expected = np.cumsum([0] + [len(s) for s in samples]).tolist()
    assert (
        starts[: len(samples) + 1]
        == expected[: len(samples) + (1 if mb.total_tokens > mb.real_tokens else 0)]
    )
    assert float(mb.mask[mb.real_tokens :].sum()) == 0.0
    assert 0 < non_padding_fraction([mb]) <= 1


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float64, attn_implementation="sdpa")
    return m.train()


def _loss_and_grads(model, mb, cfg):
    model.zero_grad()
    logp, ent = forward_logprobs(model, mb, entropy="grad")
    loss, _, _ = microbatch_loss(logp, ent, mb, cfg, version=0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), loss.detach(), grads


@pytest.mark.parametrize("row_tokens", [None, 1, 40])
@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_packed_equals_padded_loss_and_grads(model, policy_loss, row_tokens):
    """One row, rows as wide as the longest sequence, and rows of 40 tokens alike."""
    cfg = LossConfig(policy_loss=policy_loss, entropy_coef=0.01, off_policy="tis")
    samples = _samples(2, seed=3, min_len=5, max_len=30)
    packed = packed_microbatch(samples, pad_multiple=16, row_tokens=row_tokens)
    assert packed.input_ids.shape[0] == (1 if row_tokens is None else len(first_fit_decreasing(
        [len(s) for s in samples], max(row_tokens, *(len(s) for s in samples)))))  # fmt: skip
    padded = padded_microbatch(samples)
    lp_packed, loss_packed, g_packed = _loss_and_grads(model, packed, cfg)
    lp_padded, loss_padded, g_padded = _loss_and_grads(model, padded, cfg)
    for i in range(len(samples)):  # rows may hold the sequences in another order
        at_packed, at_padded = (
            (packed.seq_idx == i) & packed.mask.bool(),
            (padded.seq_idx == i) & padded.mask.bool(),
        )
        torch.testing.assert_close(lp_packed[at_packed], lp_padded[at_padded], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-6, atol=1e-9)  # logits are cast to fp32
    assert g_packed.keys() == g_padded.keys()
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_padded[name], rtol=1e-5, atol=1e-8, msg=name)


def test_without_position_resets_sequences_would_attend_to_each_other(model):
    """The check above can fail: a row without restarts is one long causal sequence."""
    samples = _samples(1, seed=5)[:3]
    packed = packed_microbatch(samples, pad_multiple=1)
    joined = packed_microbatch(samples, pad_multiple=1)
    joined.position_ids = torch.arange(joined.total_tokens)[None]
    with torch.no_grad():
        a = forward_logprobs(model, packed)[0]
        b = forward_logprobs(model, joined)[0]
    first = len(samples[0])
    torch.testing.assert_close(a[:first], b[:first])  # the first sequence sees nothing else either way
    assert not torch.allclose(a[first:], b[first:])


def test_rows_hold_at_most_their_width_and_every_sequence_once():
    samples = _samples(3, seed=1, min_len=4, max_len=50)
    longest = max(len(s) for s in samples)
    mb = packed_microbatch(samples, pad_multiple=8, row_tokens=1)
    rows, width = mb.input_ids.shape
    assert rows > 1 and width % 8 == 0 and width < longest + 8
    seq = mb.seq_idx.view(rows, width)
    pos = mb.position_ids
    for i, s in enumerate(samples):  # sequence i sits whole in one row, positions 0..len-1
        where = (seq == i).nonzero()
        assert len(where) == len(s) and len(set(where[:, 0].tolist())) == 1
        assert pos[where[:, 0], where[:, 1]].tolist() == list(range(len(s)))
        assert mb.input_ids[where[:, 0], where[:, 1]].tolist() == s.tokens.tolist()
    assert float(mb.mask[mb.seq_idx == len(samples)].sum()) == 0.0
    assert mb.real_tokens == sum(len(s) for s in samples) and mb.num_seqs == len(samples) + 1


def test_row_width_follows_the_attention_implementation():
    from types import SimpleNamespace

    from agentrl.learner.state import row_tokens

    def model(attn):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))

    assert row_tokens(0, model("sdpa")) == 1 and row_tokens(0, model("eager")) == 1
    assert row_tokens(0, model("flash_attention_2")) is None
    assert row_tokens(None, model("sdpa")) is None and row_tokens(256, model("flash_attention_2")) == 256


def test_padded_plan_covers_all_samples_within_budget():
    samples = _samples(3, min_len=4, max_len=50)
    mbs = padded_plan(samples, 128)
    assert sum(mb.input_ids.shape[0] for mb in mbs) == len(samples)
    assert all(mb.total_tokens <= 128 or mb.input_ids.shape[0] == 1 for mb in mbs)
    assert non_padding_fraction(mbs) < non_padding_fraction(plan_microbatches(samples, 128, pad_multiple=1))
