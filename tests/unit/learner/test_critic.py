"""PPO's critic on the tiny model (a real world-size-1 gloo group and FSDP2, through the learner
backend): it starts at zero and fits returns with its own AdamW; GAE over packed micro-batches
equals GAE per episode; and `loss.advantage: gae` through the loop warms the critic up with the
actor frozen, trains both, exports the critic, and resumes to the same actor and critic weights."""

import math

import numpy as np
import torch

from agentrl.config import OptimConfig
from agentrl.learner.critic import _packed_gae, critic_step
from agentrl.learner.data import prepare_batch
from agentrl.learner.fsdp import FSDP2Backend, full_state_dict
from agentrl.learner.gae import gae
from agentrl.learner.hf_model import load_value_model
from agentrl.learner.loop import build_learner, run
from agentrl.learner.packing import plan_microbatches
from agentrl.log import MetricsLogger, read_metrics
from agentrl.types import Episode
from tests.unit.learner.source import ListSource, learner_config, make_groups


def _with_turn_rewards(groups, seed=0):
    """Each episode gets two rewarded turns: one midway through its generated tokens, one at the end."""
    rng = np.random.default_rng(seed)
    for g in groups:
        for i, ep in enumerate(g.episodes):
            gen = np.flatnonzero(ep.loss_mask)
            pos = np.unique([gen[len(gen) // 2], gen[-1]]).astype(np.int32)
            rewards = rng.uniform(-1, 1, len(pos)).astype(np.float32)
            g.episodes[i] = Episode(ep.tokens, ep.loss_mask, ep.logprobs, ep.versions, reward=float(rewards.sum()),
                                    reward_pos=pos, turn_rewards=rewards)  # fmt: skip
    return groups


def test_critic_fits_returns(tiny_model):
    backend = FSDP2Backend()
    torch.manual_seed(0)
    critic = backend.build("value", tiny_model, name="critic", optim=OptimConfig(lr=3e-3))
    batch = prepare_batch(make_groups(2, seed=4), advantage="grpo", loss_agg="token_mean", vocab_size=1000,
                          learner_version=0)  # fmt: skip
    mbs = plan_microbatches(batch.mini_batches[0], 4096)
    for mb in mbs:
        # a target the critic can learn from the context: each episode's advantage on its action positions
        mb.extra["returns"] = torch.where(mb.mask > 0, mb.adv, torch.zeros_like(mb.adv))
    history = []
    for _ in range(25):
        with backend.frozen(critic):
            for mb in mbs:
                mb.extra["old_values"] = backend.values(critic, mb)
        if not history:
            assert all(
                float(mb.extra["old_values"].abs().max()) == 0.0 for mb in mbs
            )  # zero-initialised head
        history.append(
            critic_step(backend, critic, mbs, learner_config().critic.model_copy(update={"value_clip": None}))
        )
    assert all(h["critic/step_skipped"] == 0 for h in history)
    assert history[-1]["critic/value_loss"] < 0.3 * history[0]["critic/value_loss"]
    assert history[0]["critic/explained_variance"] <= 0 < history[-1]["critic/explained_variance"]
    for mb in mbs:  # clipping bounds how far the steps of one batch move the values from the old ones
        mb.extra["old_values"] = backend.values(critic, mb).detach()
    clip = learner_config().critic.model_copy(update={"value_clip": 1e-4})
    first = critic_step(backend, critic, mbs, clip)
    assert first["critic/clipfrac"] == 0  # its forward is the old values' (no dropout before the head)
    second = critic_step(backend, critic, mbs, clip)  # a second mini-batch step against the same old values
    assert 0 < second["critic/clipfrac"] <= 1


def test_gae_over_packed_micro_batches_equals_gae_per_episode():
    groups = _with_turn_rewards(make_groups(3, seed=5), seed=1)
    batch = prepare_batch(groups, advantage="gae", loss_agg="token_mean", vocab_size=1000, learner_version=0)
    assert all(s.advantage == 0.0 for s in batch.mini_batches[0])  # left to the critic
    mbs = plan_microbatches(batch.mini_batches[0], 96)  # several sequences per row
    assert any(mb.num_seqs > 2 for mb in mbs)
    rng = np.random.default_rng(2)
    expected_total, got_total = 0, 0
    for mb in mbs:
        mb.extra["old_values"] = torch.from_numpy(rng.normal(size=mb.mask.shape[0]).astype(np.float32))
        adv, ret = _packed_gae(mb, gamma=0.9, lam=0.8)
        seq = mb.seq_idx.numpy()
        for s in range(mb.num_seqs):
            rows = np.flatnonzero(seq == s)
            if not mb.mask[rows].any():
                continue  # the padding
            # the episode this sequence is: its tokens, loss mask and token rewards, shifted so
            # position p carries token p+1 (as packing lays them out)
            tokens = mb.input_ids[0, rows].numpy()
            ep = next(e for g in groups for e in g.episodes if len(e.tokens) == len(tokens)
                      and np.array_equal(e.tokens, tokens))  # fmt: skip
            r = np.r_[ep.token_rewards()[1:], 0.0]
            m = np.r_[ep.loss_mask[1:], 0]
            a, ret_e = gae(r, mb.extra["old_values"].numpy()[rows], m, 0.9, 0.8)
            np.testing.assert_allclose(adv.numpy()[rows], a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(ret.numpy()[rows], ret_e, rtol=1e-5, atol=1e-6)
            expected_total += 1
        got_total += mb.num_seqs
    assert expected_total == sum(len(g.episodes) for g in groups)


def _ppo_cfg(tiny_model, **kw):
    base = dict(model_path=str(tiny_model), groups_per_step=2, micro_batch_tokens=64, lr=1e-3, batch_timeout_s=0.1,
                advantage="gae", gamma=1.0, lam=0.95, critic={"optim": {"lr": 1e-3}, "warmup_steps": 1, "export": True})  # fmt: skip
    return learner_config(**{**base, **kw})


def _state(part):
    return {k: v.clone() for k, v in full_state_dict(part.module).items()}


def test_ppo_loop_warms_up_the_critic_trains_both_exports_and_resumes(tiny_model, tmp_path):
    groups = _with_turn_rewards(make_groups(8, seed=3), seed=3)
    straight = build_learner(_ppo_cfg(tiny_model, max_steps=3), tmp_path / "straight")
    actor0, critic0 = _state(straight.actor), _state(straight.critic)
    metrics = MetricsLogger(tmp_path / "straight")
    source = ListSource(groups)
    assert run(straight, source, max_staleness=4, metrics=metrics) == 3
    metrics.close()
    rows = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the warm-up step makes no version
    assert [r["critic/warmup"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    assert "loss" not in rows[0] and all("loss" in r for r in rows[1:])
    # the warm-up batch trained the critic only: it goes back as skipped, returning its admission
    assert source.cursor == 8 and source.dropped == [g.group_id for g in groups[:2]]
    for key in ("critic/value_loss", "critic/explained_variance", "adv/gae_mean", "adv/gae_std"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[0]["critic/explained_variance"] <= 0  # values start at 0
    actor, critic = _state(straight.actor), _state(straight.critic)
    assert any(not torch.equal(actor0[k], actor[k]) for k in actor0)
    assert any(not torch.equal(critic0[k], critic[k]) for k in critic0)

    from transformers import AutoModelForTokenClassification

    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "straight" / "hf_critic" / "latest")
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, critic[name], msg=name)
    reloaded = load_value_model(tmp_path / "straight" / "hf_critic" / "latest", torch.device("cpu"))
    assert float(reloaded.score.weight.detach().abs().sum()) > 0  # an exported critic keeps its head

    first = build_learner(_ppo_cfg(tiny_model, max_steps=1), tmp_path / "resumed")
    run(first, ListSource(groups), max_staleness=4)
    second = build_learner(_ppo_cfg(tiny_model, max_steps=3), tmp_path / "resumed")
    fresh = ListSource(groups)
    assert run(second, fresh, max_staleness=4, resume_from_checkpoint=True) == 3
    assert fresh.cursor == 8 and not second.critic_warming_up
    for expected, got in ((actor, _state(second.actor)), (critic, _state(second.critic))):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
