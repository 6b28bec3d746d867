"""Per-token staleness (`learner.staleness: token`) against an oracle from its definition.

An episode that spans weight pushes carries tokens of several versions. With the bound k at
learner version v, a generated token of version u trains iff v − u ≤ k; the rest of the episode
trains, and the batch loss is the token mean over exactly those tokens:

    L = (1 / #fresh) Σ_fresh −A_i · min(π_old/π_behav, C)·r,   A_i = R_i − mean_group(R)  (Dr. GRPO)

The oracle builds the fresh-token set itself from the episodes' masks (with tool-output holes) and
versions; agentrl's path is the consumer's masking (`queue.base.mask_stale`), `prepare_batch`,
packing and `microbatch_loss`. Loss and gradient must agree to float32 precision (packing
stores advantages and weights in float32).
"""

import numpy as np
import pytest
import torch

from agentrl.config import LossConfig
from agentrl.learner.data import prepare_batch
from agentrl.learner.packing import packed_microbatch
from agentrl.learner.train_step import microbatch_loss
from agentrl.queue.base import mask_stale
from agentrl.types import Episode, Group

VERSION, BOUND, CAP = 6, 2, 1.5


def _episode(rng: np.random.Generator, turns: list[tuple[int, int, int]], reward: float) -> Episode:
    """`turns`: (tool tokens before, generated tokens, their version) after a 3-token prompt."""
    mask, versions = [0, 0, 0], [-1, -1, -1]
    for tool, gen, version in turns:
        mask += [0] * tool + [1] * gen
        versions += [-1] * tool + [version] * gen
    n = len(mask)
    m = np.array(mask, np.uint8)
    logprobs = np.where(m == 1, -rng.uniform(0.2, 3.0, n), 0.0).astype(np.float32)
    return Episode(rng.integers(0, 500, n), m, logprobs, np.array(versions), reward=reward)


def _groups() -> list[Group]:
    rng = np.random.default_rng(3)
    return [
        Group([  # spans pushes: versions 3 (stale at v=6, k=2), 4 and 5 (fresh), with tool holes
            _episode(rng, [(0, 4, 3), (2, 3, 4), (3, 5, 5)], 1.0),
            _episode(rng, [(0, 6, 3), (4, 2, 3)], 0.0),  # wholly stale: trains nothing, keeps its reward
            _episode(rng, [(0, 3, 4), (1, 4, 6)], 0.5),
        ]),
        Group([
            _episode(rng, [(0, 5, 2), (2, 5, 5)], 0.2),
            _episode(rng, [(0, 7, 6)], 0.9),
        ]),
    ]  # fmt: skip


def test_masking_keeps_fresh_tokens_and_is_a_copy():
    groups = _groups()
    masked, share = mask_stale(groups, VERSION, BOUND)
    generated = sum(e.num_generated for g in groups for e in g.episodes)
    stale = sum(
        int(((e.loss_mask == 1) & (e.versions < VERSION - BOUND)).sum()) for g in groups for e in g.episodes
    )
    assert share == pytest.approx(stale / generated) and 0 < share < 1
    for before, after in zip(groups, masked, strict=True):
        assert before.is_admissible(VERSION, BOUND, per_token=True)
        assert not before.is_admissible(VERSION, BOUND)  # the per-group rule would drop both
        for e0, e1 in zip(before.episodes, after.episodes, strict=True):
            np.testing.assert_array_equal(e1.loss_mask, e0.loss_mask * (e0.versions >= VERSION - BOUND))
            assert e1.tokens is e0.tokens  # arrays shared, the mask new
    assert (
        sum(e.num_generated for e in groups[0].episodes) == 4 + 3 + 5 + 6 + 2 + 3 + 4
    )  # originals untouched
    old = Group([_episode(np.random.default_rng(0), [(0, 4, 3), (1, 2, 1)], 1.0)])
    assert not old.is_admissible(VERSION, BOUND, per_token=True)  # nothing fresh: dropped as stale


def test_loss_and_gradient_equal_the_oracle():
    cfg = LossConfig(advantage="dr_grpo", off_policy="tis", is_cap=CAP, loss_agg="token_mean")
    groups = _groups()
    masked, _ = mask_stale(groups, VERSION, BOUND)
    batch = prepare_batch(masked, advantage=cfg.advantage, loss_agg=cfg.loss_agg, vocab_size=500,
                          learner_version=VERSION)  # fmt: skip
    samples = batch.mini_batches[0]
    mb = packed_microbatch(samples)
    mb.mask, mb.behav_logp, mb.adv, mb.weight = (
        x.double() for x in (mb.mask, mb.behav_logp, mb.adv, mb.weight)
    )
    g = torch.Generator().manual_seed(1)
    logp0 = (mb.behav_logp + torch.randn(mb.mask.shape, generator=g, dtype=torch.float64) * 0.5) * mb.mask
    logp = logp0.clone().requires_grad_()
    loss, sums, _ = microbatch_loss(logp, None, mb, cfg, version=VERSION)
    loss.backward()

    # the oracle, from the original (unmasked) episodes: same packing layout, its own fresh set
    plain = prepare_batch(groups, advantage=cfg.advantage, loss_agg=cfg.loss_agg, vocab_size=500,
                          learner_version=VERSION)  # fmt: skip
    ref_mb = packed_microbatch(plain.mini_batches[0])
    fresh = (ref_mb.mask == 1) & (VERSION - ref_mb.versions <= BOUND)
    assert 0 < int(fresh.sum()) < int(ref_mb.mask.sum())
    adv = {}
    for gi, group in enumerate(groups):
        rewards = [e.reward for e in group.episodes]
        for ei, r in enumerate(rewards):
            adv[gi, ei] = r - sum(rewards) / len(rewards)
    seq_adv = torch.tensor([adv[k] for k in sorted(adv)], dtype=torch.float64)
    ref = logp0.clone().requires_grad_()
    behav = ref_mb.behav_logp.double()
    total = torch.zeros((), dtype=torch.float64)
    for t in fresh.nonzero().flatten().tolist():
        a = seq_adv[int(ref_mb.seq_idx[t])]
        w = min(float(torch.exp(ref[t].detach() - behav[t])), CAP)
        r = torch.exp(ref[t] - ref[t].detach())
        total = total - a * w * r
    total = total / int(fresh.sum())
    total.backward()
    # packing stores advantages and aggregation weights in float32: equal to float32 precision
    torch.testing.assert_close(loss.detach(), total.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-6, atol=1e-9)
    assert sums["tokens"] == int(fresh.sum())
