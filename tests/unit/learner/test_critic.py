"""The critic on the tiny model (a real world-size-1 gloo group and FSDP2): it starts at zero,
its values line up with the packed positions, and its own AdamW fits returns (value loss down,
explained variance above 0)."""

import torch

from agentrl.learner import fsdp
from agentrl.learner.critic import build_critic, critic_step, critic_values, store_old_values
from agentrl.learner.data import prepare_batch
from agentrl.learner.packing import plan_microbatches
from tests.unit.learner.source import make_groups


def test_critic_fits_returns(tiny_model):
    _, world, device = fsdp.init_distributed()
    torch.manual_seed(0)
    critic = build_critic(tiny_model, device, lr=3e-3)
    batch = prepare_batch(make_groups(2, seed=4), advantage="grpo", loss_agg="token_mean", vocab_size=1000,
                          learner_version=0)  # fmt: skip
    mbs = plan_microbatches(batch.mini_batches[0], 4096)
    for mb in mbs:
        # a target the critic can learn from the context: each episode's reward on its action positions
        mb.extra["returns"] = torch.where(mb.mask > 0, mb.adv, torch.zeros_like(mb.adv))
    store_old_values(critic.model, mbs)
    assert all(float(mb.extra["old_values"].abs().max()) == 0.0 for mb in mbs)  # zero-initialised head
    assert critic_values(critic.model, mbs[0]).shape == mbs[0].mask.shape
    history = []
    for _ in range(25):
        store_old_values(critic.model, mbs)
        history.append(critic_step(critic, mbs, world, clip=None, max_grad_norm=1.0))
    assert all(h["critic/step_skipped"] == 0 for h in history)
    assert history[-1]["critic/value_loss"] < 0.3 * history[0]["critic/value_loss"]
    assert history[0]["critic/explained_variance"] <= 0 < history[-1]["critic/explained_variance"]
    # clipping bounds how far one step moves the values
    store_old_values(critic.model, mbs)
    m = critic_step(critic, mbs, world, clip=1e-4, max_grad_norm=1.0)
    assert 0 <= m["critic/clipfrac"] <= 1
