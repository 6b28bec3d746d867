"""The learner loop on one rank (a real world-size-1 gloo group and FSDP2), fed by an
in-process source with the queue consumer's methods: it trains, publishes versions, acks,
logs metrics, exports a loadable HF checkpoint, skips bad input with counted reasons, skips
non-finite steps without touching the weights, and resumes to the same weights."""

import math

import numpy as np
import pytest
import torch

from agentrl.learner.fsdp import full_state_dict
from agentrl.learner.loop import build_learner, run
from agentrl.log import MetricsLogger, read_metrics
from tests.unit.learner.source import ListSource, learner_config, make_groups


def _cfg(tiny_model, **kw):
    base = dict(model_path=str(tiny_model), groups_per_step=2, max_steps=3, micro_batch_tokens=64, lr=1e-3,
                warmup_steps=2, batch_timeout_s=0.1)  # fmt: skip
    return learner_config(**{**base, **kw})


def _weights(learner):
    return {k: v.clone() for k, v in full_state_dict(learner.model).items()}


class Pushes:
    def __init__(self):
        self.versions, self.names = [], []

    def push(self, weights, version):
        self.versions.append(version)
        self.names = [name for name, _ in weights()]


def test_loop_trains_publishes_acks_logs_and_exports(tiny_model, tmp_path):
    learner = build_learner(_cfg(tiny_model), tmp_path)
    before = _weights(learner)
    source = ListSource(make_groups(6))
    sync = Pushes()
    metrics = MetricsLogger(tmp_path)
    assert run(learner, source, max_staleness=1, weight_sync=sync, metrics=metrics) == 3
    metrics.close()
    assert source.versions == [0, 1, 2, 3]
    assert sync.versions == [1, 2, 3]
    assert (
        "model.embed_tokens.weight" in sync.names and "model.layers.0.self_attn.q_proj.weight" in sync.names
    )
    assert source.acked == [g.group_id for g in source.groups]
    after = _weights(learner)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm", "reward/mean", "adv/std", "clipfrac", "is_weight/mean", "mismatch_kl/k3",
                "entropy", "tokens_per_s", "time/wait_data_s", "packing/non_padding_frac", "lr", "staleness/2"):  # fmt: skip
        assert key in rows[-1], key
    assert rows[0]["staleness/0"] == 2  # groups made at version 0, consumed at 0, 1, 2
    assert [r["lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3])  # two warm-up steps, then constant

    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "latest")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    AutoTokenizer.from_pretrained(tmp_path / "hf" / "latest")
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, after[name], msg=name)


def test_bad_input_is_skipped_and_counted(tiny_model, tmp_path):
    groups = make_groups(6, seed=1)
    groups[0].episodes[1].reward = float("nan")
    groups[1].episodes[0].logprobs = np.zeros(3, dtype=np.float32)  # arrays disagree
    groups[2].episodes[2].tokens[3] = 5000  # beyond the vocabulary
    for ep in groups[3].episodes:  # nothing to train on in this batch
        ep.loss_mask[:] = 0
    learner = build_learner(_cfg(tiny_model, max_steps=1), tmp_path)
    metrics = MetricsLogger(tmp_path)
    source = ListSource(groups)
    run(learner, source, max_staleness=1, metrics=metrics)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    last = rows[-1]
    assert last["skipped/nonfinite_reward"] == 1
    assert last["skipped/arrays_disagree"] == 1
    assert last["skipped/token_out_of_vocab"] == 1
    assert last["skipped/no_generated_tokens"] == 1
    assert last["skipped/no_trainable_tokens"] == 2  # batches 1 and 2 had nothing left
    assert learner.version == 1 and source.cursor == 6
    # the skipped batches' groups go back as dropped, returning the rollers' admission
    assert source.dropped == [g.group_id for g in groups[:4]]
    assert all(torch.isfinite(v).all() for v in _weights(learner).values())


def test_nonfinite_step_is_skipped_and_weights_untouched(tiny_model, tmp_path):
    learner = build_learner(_cfg(tiny_model, max_steps=1), tmp_path)
    before = _weights(learner)
    layer = learner.model.model.layers[0]
    calls = {"n": 0}

    def poison(module, args, output):  # the outside edge misbehaves once: a NaN activation
        calls["n"] += 1
        if calls["n"] == 1:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden * float("nan")
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return output

    handle = layer.register_forward_hook(poison)
    metrics = MetricsLogger(tmp_path)
    learner.cfg.micro_batch_tokens = 4096  # one micro-batch per step
    source = ListSource(make_groups(4, seed=2))
    run(learner, source, max_staleness=1, metrics=metrics, weight_sync=None)
    handle.remove()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["step_skipped"] == 1 and rows[0]["step"] == 0
    assert rows[0]["skipped/nonfinite_step"] == 1
    assert rows[1]["step_skipped"] == 0 and rows[1]["step"] == 1
    assert not math.isfinite(float(rows[0]["grad_norm"]))
    after = _weights(learner)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert source.versions == [0, 1]
    assert len(source.dropped) == len(source.acked) // 2  # the first batch of two went back as skipped
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the second batch trained


@pytest.mark.parametrize("off_policy", ["tis", "decoupled"])
def test_resume_gives_the_same_weights_as_a_straight_run(tiny_model, tmp_path, off_policy):
    groups = make_groups(8, seed=3)
    kw = dict(max_steps=4, off_policy=off_policy, mini_batches=2 if off_policy == "decoupled" else 1)
    straight = build_learner(_cfg(tiny_model, **kw), tmp_path / "straight")
    run(straight, ListSource(groups), max_staleness=1)
    expected = _weights(straight)

    first = build_learner(_cfg(tiny_model, **{**kw, "max_steps": 2}), tmp_path / "resumed")
    source = ListSource(groups)
    run(first, source, max_staleness=1)
    second = build_learner(_cfg(tiny_model, **kw), tmp_path / "resumed")
    fresh_source = ListSource(groups)  # a new process: the cursor comes back from the checkpoint
    assert run(second, fresh_source, max_staleness=1, resume_from_checkpoint=True) == 4
    assert fresh_source.versions[0] == 2 and fresh_source.cursor == 8
    got = _weights(second)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    optim = second.optimizer.state_dict()["state"]
    assert optim and all(int(s["step"]) == 4 * kw["mini_batches"] for s in optim.values())


def test_activation_checkpointing_gives_the_same_update(tiny_model, tmp_path):
    groups = make_groups(2, seed=4)
    results = []
    for ac in (False, True):
        learner = build_learner(
            _cfg(tiny_model, max_steps=1, activation_checkpointing=ac), tmp_path / str(ac)
        )
        run(learner, ListSource(groups), max_staleness=1)
        results.append(_weights(learner))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            policy_loss="gspo",
            advantage="dr_grpo",
            loss_agg="seq_mean_token_sum",
            clip_low=3e-4,
            clip_high=4e-4,
        ),
        dict(advantage="reinforce_pp", off_policy="none", dual_clip=3.0, kl_coef=0.1, kl_estimator="k3"),
        dict(policy_loss="cispo", off_policy="icepop", mini_batches=2),  # π_old recomputed for the mask
        dict(off_policy="seq_tis", seq_mask=(0.05, 20.0)),
    ],
)
def test_other_objectives_train(tiny_model, tmp_path, overrides):
    learner = build_learner(_cfg(tiny_model, max_steps=1, **overrides), tmp_path)
    before = _weights(learner)
    metrics = MetricsLogger(tmp_path)
    run(learner, ListSource(make_groups(2, seed=6)), max_staleness=1, metrics=metrics)
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["step_skipped"] == 0 and math.isfinite(row["loss"])
    after = _weights(learner)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if overrides.get("kl_coef"):
        assert row["kl_ref"] >= 0  # k3 is non-negative; the reference is the initial policy
    # every step logs the corrections' masked shares and the mismatch KL (k3, non-negative)
    assert 0 <= row["is_weight/masked_frac"] <= 1 and 0 <= row["is_weight/seq_masked_frac"] <= 1
    assert row["mismatch_kl/k3"] >= 0


def test_micro_batch_budget_does_not_change_the_update(tiny_model, tmp_path):
    """Gradients accumulated over several micro-batches (kept unreduced and gathered until the
    last one on a single rank) give the same step as one micro-batch holding everything."""
    updated = {}
    for budget in (48, 4096):
        learner = build_learner(
            _cfg(tiny_model, max_steps=1, micro_batch_tokens=budget), tmp_path / str(budget)
        )
        metrics = MetricsLogger(tmp_path / str(budget))
        run(learner, ListSource(make_groups(2, seed=9)), max_staleness=1, metrics=metrics)
        metrics.close()
        micro_batches = read_metrics(tmp_path / str(budget) / "metrics.jsonl")[-1]["packing/micro_batches"]
        assert micro_batches == 1 if budget == 4096 else micro_batches > 1
        updated[budget] = _weights(learner)
    for name, tensor in updated[4096].items():
        torch.testing.assert_close(updated[48][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_steps_of_groups_that_generated_nothing_end_the_run_saying_why(tiny_model, tmp_path):
    groups = make_groups(4, seed=2)
    for g in groups:  # what a roller sends when the prompt fills roller.max_total_tokens
        for ep in g.episodes:
            ep.loss_mask[:] = 0
            ep.finish_reason = "context"
            ep.metrics["prompt_tokens"] = len(ep.tokens)
    prompt = max(len(ep.tokens) for ep in groups[-1].episodes)
    learner = build_learner(_cfg(tiny_model, max_steps=5, max_consecutive_skips=2), tmp_path)
    with pytest.raises(RuntimeError) as raised:
        run(learner, ListSource(groups), max_staleness=1)
    said = str(raised.value)
    assert said.startswith("2 consecutive learner steps skipped ({'no_generated_tokens': 4")
    assert f"the last: 4 episodes ended with no generated token: context ×4; prompt {prompt} tokens" in said
    assert "the prompt fills roller.max_total_tokens" in said
