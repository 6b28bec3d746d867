"""Fixes of what an independent check of the learner found, each pinned by a test that failed
before: GSPO honours dual_clip, GSPO defaults to its sequence mean, k1 as a loss term is refused,
the final checkpoint and export are written once, and frozen log-probs are recomputed without
dropout. Dr. GRPO's normaliser against TRL's is pinned in test_trl_oracle.py."""

import math

import pytest
import torch

from agentrl.config import ConfigError, LossConfig, load_config
from agentrl.learner import checkpoint, fsdp, loop
from agentrl.learner.hf_model import forward_logprobs
from agentrl.learner.packing import MicroBatch
from agentrl.learner.train_step import microbatch_loss, recompute_logprobs
from tests.unit.learner.source import ListSource, learner_config, make_groups


def _mb(adv):
    n = len(adv) + 1
    return MicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None], attention_mask=None,
        targets=torch.zeros(n, dtype=torch.long), mask=torch.tensor([1.0] * (n - 1) + [0.0]),
        behav_logp=torch.zeros(n), versions=torch.zeros(n, dtype=torch.long), adv=torch.tensor([*adv, 0.0]),
        weight=torch.full((n,), 1.0 / (n - 1)), seq_idx=torch.zeros(n, dtype=torch.long), num_seqs=1,
        real_tokens=n,
    )  # fmt: skip


def test_gspo_applies_dual_clip_to_negative_advantages():
    # sequence log-ratio mean 2 → s = e² = 7.39 with A = −1: PPO-clip keeps 7.39, dual clip c = 3 caps it
    logp = torch.tensor([2.0, 2.0, 0.0])
    cfg = LossConfig(policy_loss="gspo", off_policy="none", dual_clip=3.0, clip_low=0.2, clip_high=0.2)
    loss, sums, _ = microbatch_loss(logp, None, _mb([-1.0, -1.0]), cfg, version=0)
    assert float(loss) == pytest.approx(3.0)
    assert sums["clipfrac"] == 2
    without = LossConfig(policy_loss="gspo", off_policy="none", clip_low=0.2, clip_high=0.2)
    assert float(microbatch_loss(logp, None, _mb([-1.0, -1.0]), without, version=0)[0]) == pytest.approx(
        math.e**2
    )


def test_gspo_defaults_to_the_sequence_mean_and_keeps_an_explicit_choice(tmp_path):
    assert LossConfig(policy_loss="gspo").loss_agg == "seq_mean_token_mean"
    assert LossConfig(policy_loss="gspo", loss_agg="token_mean").loss_agg == "token_mean"
    assert LossConfig().loss_agg == "token_mean"
    preset = tmp_path / "p.yaml"
    preset.write_text("learner:\n  loss:\n    policy_loss: gspo\n")
    assert load_config(preset, []).learner.loss.loss_agg == "seq_mean_token_mean"


def test_k1_as_a_loss_term_is_refused(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("learner:\n  loss:\n    kl_coef: 0.1\n    kl_estimator: k1\n")
    with pytest.raises(ConfigError, match=r"kl_estimator: k1 .* zero expected gradient"):
        load_config(preset, [])
    LossConfig(kl_estimator="k1")  # no penalty: nothing to refuse
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(policy_loss="cispo", dual_clip=3.0)


def test_final_checkpoint_and_export_are_written_once(tiny_model, tmp_path, monkeypatch):
    saves, exports = [], []
    real_save, real_export = checkpoint.save_checkpoint, fsdp.export_hf
    monkeypatch.setattr(
        checkpoint, "save_checkpoint", lambda *a, **k: saves.append(a[3]) or real_save(*a, **k)
    )
    monkeypatch.setattr(fsdp, "export_hf", lambda *a, **k: exports.append(str(a[1])) or real_export(*a, **k))
    cfg = learner_config(model_path=str(tiny_model), groups_per_step=1, max_steps=2, micro_batch_tokens=64,
                        checkpoint_every=1, export_every=2, batch_timeout_s=0.1)  # fmt: skip
    loop.run(loop.build_learner(cfg, tmp_path), ListSource(make_groups(2)), max_staleness=2)
    assert saves == [1, 2]
    assert [p.rsplit("/", 1)[1] for p in exports] == ["step_00000002"]


def test_frozen_logprobs_are_recomputed_without_dropout(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.backend import ModelPart
    from agentrl.learner.data import prepare_batch
    from agentrl.learner.fsdp import FSDP2Backend
    from agentrl.learner.packing import plan_microbatches

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, attention_dropout=0.5, attn_implementation="eager"
    )
    batch = prepare_batch(make_groups(1), advantage="grpo", loss_agg="token_mean", vocab_size=10**6,
                          learner_version=0)  # fmt: skip
    mbs = plan_microbatches(batch.mini_batches[0], 4096)
    model.train()
    with torch.no_grad():
        noisy = forward_logprobs(model, mbs[0])[0]  # dropout active: not the policy's log-probs
    backend, part = FSDP2Backend(), ModelPart("actor", "policy", model)  # the unsharded model
    recompute_logprobs(backend, part, mbs, "old_logp", 1.0)
    first = mbs[0].extra["old_logp"]
    recompute_logprobs(backend, part, mbs, "old_logp", 1.0)
    assert model.training  # the mode is restored
    torch.testing.assert_close(mbs[0].extra["old_logp"], first, rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(first, forward_logprobs(model, mbs[0])[0], rtol=0, atol=0)
    assert not torch.equal(noisy, first)
