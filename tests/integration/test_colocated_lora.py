"""Colocated mode with LoRA on 2 real gloo ranks: the first reshard gives the engines the frozen base,
every later one only the adapters' lora_A / lora_B, and after each reshard the engine (prefill,
the lean decode step, prompt log-probs) computes what the training PEFT model's forward does; a
run killed after a checkpoint and resumed ends with the same adapter as the run left alone."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 3
SEQ = [3, 17, 42, 8, 99, 5, 23, 61, 12, 7, 30, 44]  # a fixed token sequence, scored every step


def _learner_logprobs(model, seq: list[int]) -> list[float]:
    """log P(t_i | t_<i), i >= 1, under the training PEFT model (a collective: FSDP gathers)."""
    import torch

    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def _engine_sample(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A seeded sampled continuation from the engine thread: its tokens and their log-probs."""
    import concurrent.futures

    from agentrl.inference.engine import Request
    from agentrl.inference.sampling import SamplingParams

    done: concurrent.futures.Future = concurrent.futures.Future()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=11)
    engine.submit(Request("probe", list(prompt), params, on_done=done.set_result))
    req = done.result(timeout=60)
    assert req.finish_reason["type"] == "length", req.finish_reason
    return list(req.output_ids), list(req.logprobs)


def _worker(rank: int, world: int, port: int, model: str, out_dir: str, lora_mode: str) -> None:
    import torch
    import torch.distributed as dist

    from agentrl.colocated.loop import ColocatedRank
    from agentrl.config import load_config
    from agentrl.hybrid.procs import init_gloo
    from agentrl.inference.prompt_logprobs import engine_prompt_logprobs

    init_gloo(rank, world, port)
    args = [f"--run_dir={out_dir}/run", f"--learner.model_path={model}", "--learner.warmstart.steps=0",
            "--learner.groups_per_step=2", f"--learner.max_steps={STEPS}", "--learner.optim.lr=3e-2",
            "--roller.group_size=4", "--roller.max_new_tokens=6", "--learner.micro_batch_tokens=256",
            "--learner.lora.rank=4", f"--weight_sync.lora_mode={lora_mode}"]  # fmt: skip
    cfg = load_config(
        "recipes/quickstart_colocated_lora.yaml", args, uses=("learner", "roller", "env", "colocated")
    )
    r = ColocatedRank(cfg)
    engine, peft = r.engine, r.learner.model
    named = dict(peft.named_parameters())
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in named.items() if p.requires_grad)
    base_bytes = sum(p.numel() * p.element_size() for n, p in named.items() if not p.requires_grad)
    steps = []
    try:
        for _ in range(STEPS):
            groups, m = r.generate()  # reshard, generate, release
            # the check: one more reshard (adapters only), the engine against the training forward
            probe = r.reshard()
            scored = engine.call(lambda: engine_prompt_logprobs(engine, [SEQ])).result()[0][1:]
            tokens, sampled = _engine_sample(engine, SEQ[:6])
            merged = [m.merged for m in r.gen_model.modules() if hasattr(m, "merged_adapters")]
            r.hybrid.release()
            peft.eval()
            expected = _learner_logprobs(peft, SEQ)
            expected_sampled = _learner_logprobs(peft, SEQ[:6] + tokens)[5:]
            for group in groups:  # the untrained model earns no reward: rewards that move the adapter
                for i, episode in enumerate(group.episodes):
                    episode.reward = float(i % 2)
            t = r.train(groups)
            steps.append({
                "bytes": m["reshard/bytes"], "base_bytes": m.get("reshard/base_bytes"),
                "adapter_bytes": m.get("reshard/adapter_bytes"), "probe_bytes": probe.gathered_bytes,
                "merged_layers": merged,
                "probe_frozen_bytes": probe.frozen_bytes, "scored": scored, "expected": expected,
                "sampled": sampled, "expected_sampled": expected_sampled, "tokens": tokens,
                "staleness": t["staleness/max"], "mismatch": t["mismatch_kl/k3"], "skipped": t["step_skipped"],
                "engine_version": engine.weight_version, "adapter_name": engine.adapter_name,
            })  # fmt: skip
        # the base is never gathered again: a change to a base training shard does not reach the
        # engine, while the adapters still follow theirs
        norm = "model.norm.weight"
        shard = {s.name: s.local for s in r.hybrid.shards()}[norm]
        before = shard.clone()
        with torch.no_grad():
            shard.add_(1.0)
        r.reshard()
        gen = dict(r.gen_model.named_parameters())
        lora_name = next(n for n in gen if ".lora_B." in n)
        block = gen[norm].detach().narrow(0, rank * before.shape[0], before.shape[0])
        base_kept = bool(torch.equal(block, before))
        lora_full = named[f"base_model.model.{lora_name}"].full_tensor()
        lora_equal = bool(torch.equal(gen[lora_name].detach(), lora_full))
        r.hybrid.release()
    finally:
        r.close()
    out = {"steps": steps, "adapter_bytes": adapter_bytes, "base_bytes": base_bytes, "base_kept": base_kept,
           "lora_equal": lora_equal, "version": r.learner.version}  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _served_the_learner(got: dict) -> None:
    """After every reshard the engine computed what the training PEFT model does (fp32), and
    followed the adapter as it trained."""
    steps = got["steps"]
    assert got["version"] == STEPS and len(steps) == STEPS
    for i, s in enumerate(steps):
        worst = max(abs(a - b) for a, b in zip(s["scored"], s["expected"], strict=True))
        assert worst < 1e-5, (i, worst)
        worst = max(abs(a - b) for a, b in zip(s["sampled"], s["expected_sampled"], strict=True))
        assert worst < 1e-5, (i, worst, s["tokens"])
        assert s["staleness"] == 0 and s["skipped"] == 0 and s["mismatch"] < 1e-6, s
        assert s["engine_version"] == str(i) and s["adapter_name"] == f"agentrl-lora-v{i}", s
    for before, after in itertools.pairwise(steps):  # each step's log-probs differ from the last's
        change = max(abs(a - b) for a, b in zip(before["scored"], after["scored"], strict=True))
        assert change > 1e-4, change
    assert got["lora_equal"]
    assert got["adapter_bytes"] > 0 and got["base_bytes"] > got["adapter_bytes"]


def test_colocated_lora_reshards_the_base_once_and_serves_the_training_adapter(
    tiny_model: Path, tmp_path: Path
) -> None:
    from agentrl.hybrid.procs import run_ranks

    run_ranks(_worker, 2, (str(tiny_model), str(tmp_path), "adapter"), 400, "the colocated LoRA test")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        _served_the_learner(got)
        steps = got["steps"]
        assert all(not any(s["merged_layers"]) and s["merged_layers"] for s in steps)  # served unmerged
        # bytes moved: the base once (the first reshard), the adapters every time, nothing else
        first, *later = steps
        assert first["base_bytes"] == got["base_bytes"], first
        assert first["adapter_bytes"] == got["adapter_bytes"], first
        assert first["bytes"] == got["base_bytes"] + got["adapter_bytes"]
        for s in later:
            assert s["base_bytes"] == 0 and s["bytes"] == s["adapter_bytes"] == got["adapter_bytes"], s
        for s in steps:
            assert s["probe_bytes"] == got["adapter_bytes"] and s["probe_frozen_bytes"] == 0, s
        assert got["base_kept"]  # the base was not gathered again


def test_colocated_lora_merged_reshards_base_and_adapter_every_step(tiny_model: Path, tmp_path: Path) -> None:
    """`weight_sync.lora_mode: merged`: every reshard gathers base and adapter, and the engine
    serves them merged (PEFT's merge in the generation buffers), still the learner's forward."""
    from agentrl.hybrid.procs import run_ranks

    run_ranks(_worker, 2, (str(tiny_model), str(tmp_path), "merged"), 400, "the colocated merged LoRA test")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        _served_the_learner(got)
        everything = got["base_bytes"] + got["adapter_bytes"]
        for s in got["steps"]:
            assert all(s["merged_layers"]) and s["merged_layers"], s
            assert s["bytes"] == s["probe_bytes"] == everything and s["probe_frozen_bytes"] == 0, s
            assert s["base_bytes"] is None and s["adapter_bytes"] is None, s  # no split to log
        assert not got["base_kept"]  # the base is gathered at every reshard


def test_colocated_lora_run_killed_and_resumed_equals_uninterrupted(tiny_model: Path, tmp_path: Path) -> None:
    """`agentrl run` with the LoRA recipe, as tests/integration/test_colocated_resume.py runs the full-weight
    one: the checkpoint holds the adapter (PEFT format) and its optimizer state; the resumed run's
    first reshard sends the base again, once."""
    from safetensors.torch import load_file

    from tests.integration.test_colocated_resume import STEPS, _args, _kill_after_checkpoint

    config = "recipes/quickstart_colocated_lora.yaml"
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    result = run_agentrl(*_args(whole, tiny_model, config), timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    _kill_after_checkpoint(cut, tiny_model, config)
    assert (cut / "checkpoints" / "step_00000002" / "actor_adapter" / "adapter_config.json").exists()
    assert not (cut / "adapter").exists()  # killed before the end (the export comes last)
    result = run_agentrl(*_args(cut, tiny_model, config), "--resume", timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed at version 2" in result.stderr

    a = load_file(whole / "adapter" / "latest" / "adapter_model.safetensors")
    b = load_file(cut / "adapter" / "latest" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any(".lora_B." in k for k in a)
    for name, value in a.items():
        assert (value == b[name]).all(), name  # bit-identical
    assert sum(int(value.abs().max() > 0) for k, value in a.items() if ".lora_B." in k) > 10  # trained
    records = {r["step"]: r for r in read_metrics(whole / "learner.jsonl")}
    resumed = {r["step"]: r for r in read_metrics(cut / "learner.jsonl")}
    assert sorted(records) == list(range(1, STEPS + 1))
    assert [records[s]["reshard/base_bytes"] > 0 for s in sorted(records)] == [True] + [False] * (STEPS - 1)
    assert (
        resumed[3]["reshard/base_bytes"] == records[1]["reshard/base_bytes"]
        and resumed[4]["reshard/base_bytes"] == 0
    )
    for step in (3, 4):
        assert resumed[step]["loss"] == records[step]["loss"], step
