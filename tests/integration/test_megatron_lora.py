"""LoRA on the Megatron-core learner against the FSDP2 learner's PEFT LoRA (2 gloo ranks, fp32).

One torchrun launch of 2 ranks trains the same batch, with adapters on all seven Linear kinds of
the tiny model, through the real loop (decoupled PPO, KL to the adapter-disabled base, entropy)
with FSDP2 + PEFT (DP 2), Megatron TP 1 (DP 2), TP 2 (with full-layer recompute) and PP 2.
Every layout starts from the same adapter: A from the FSDP2 learner's PEFT initialisation, B
random (seeded; PEFT's B = 0 would leave A without a gradient in the first step). Per layout:
the policy's per-token log-probs equal a single-process PEFT model's and the reference's equal
the base HF model's; the step's loss, KL and gradient norm and the adapter after one AdamW step
equal FSDP2's; the pushed adapter and merged tensors carry FSDP2's names and values; the exported
adapter loads with `PeftModel.from_pretrained` and gives the trained learner's log-probs; only
adapter tensors sit in the optimizer. TP 2 resumes from its checkpoint (the same adapter and
AdamW state) and pushes its adapter, PP 2 its merged weights, over the broadcast group into one
embedded `agentrl serve`, which then serves PEFT's forward with the exported adapter.

This file is also the worker: `torchrun ... test_megatron_lora.py OUT_DIR MODEL_PATH SERVER_URL`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import Processes, end_rank, find_free_port, run_torchrun

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)
pytest.importorskip("peft", reason="peft is not installed (pip install 'agentrl[lora]')")

LORA = {"rank": 4, "alpha": 8.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip
CONFIG = dict(groups_per_step=3, max_steps=1, micro_batch_tokens=48, lr=1e-3, off_policy="decoupled",
              kl_coef=0.05, entropy_coef=0.01, loss_agg="seq_mean_token_mean", advantage="rloo", lora=LORA)  # fmt: skip
LAYOUTS = {"fsdp2": None, "tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


class Metrics:
    """The loop's metrics sink, kept in memory."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append(dict(metrics))


def _set_adapter(learner, tensors: dict) -> None:
    """Copy whole adapter tensors (PEFT's saved names) into the learner's adapter: each rank its
    TP slice (Megatron) or its FSDP2 shard."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from agentrl.learner import lora

    module = learner.actor.module
    with torch.no_grad():
        if learner.cfg.backend == "megatron":
            tp, rank = learner.backend.tp, learner.backend.tp_rank
            for name, param in module.gpt.named_parameters():
                if name in module.adapter_names:
                    whole, dim = tensors[module.adapter_names[name]], module.partition_dim(name)
                    param.copy_(whole if dim is None else whole.chunk(tp, dim=dim)[rank])
            return
        for name, param in module.named_parameters():
            saved = lora.saved_name(name)
            if saved is None:
                continue
            if isinstance(param, DTensor):
                param.to_local().copy_(
                    distribute_tensor(tensors[saved], param.device_mesh, param.placements).to_local()
                )
            else:
                param.copy_(tensors[saved])


def _peft_logprobs(model_path: str, adapter: dict | Path, mb):
    """A single-process PEFT model's log-probs: the base with `adapter` (tensors or a directory)."""
    import torch
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict

    from agentrl.learner import lora
    from agentrl.learner.fsdp import load_model
    from agentrl.learner.hf_model import forward_logprobs

    base = load_model(model_path, torch.device("cpu"))
    if isinstance(adapter, Path):
        model = PeftModel.from_pretrained(base, adapter)
    else:
        model = get_peft_model(base, lora.peft_config(lora.LoraConfig(**LORA)))
        set_peft_model_state_dict(model, adapter)
    with torch.no_grad():
        return forward_logprobs(model.eval(), mb)[0]


def _resumed_equal(learner, adapter: dict) -> bool:
    """A new learner of the same config resumes from the step's checkpoint: its adapter and AdamW
    state equal the trained learner's, and the checkpoint's shard files hold only adapters."""
    import torch

    from agentrl.learner.bookkeeping import resume
    from agentrl.learner.loop import build_learner

    again = build_learner(learner.cfg, learner.run_dir)
    assert resume(again, None) and again.version == 1
    same = all(torch.equal(t, adapter[n]) for n, t in again.backend.adapter_tensors(again.actor))
    for old, new in zip(learner.optimizer.param_groups[0]["params"], again.optimizer.param_groups[0]["params"],
                        strict=True):  # fmt: skip
        state, loaded = learner.optimizer.state[old], again.optimizer.state[new]
        same = same and all(torch.equal(state[k], loaded[k]) for k in ("exp_avg", "exp_avg_sq"))
    shard = torch.load(
        learner.run_dir / "checkpoints" / "step_00000001" / f"megatron_tp{learner.backend.tp_rank}_pp0.pt"
    )
    return same and set(shard["actor"]["model"]) == set(learner.actor.module.adapter_names)


PUSHES = {"tp2": ("adapter", 1), "pp2": ("merged", 2)}  # layout -> (weight_sync.lora_mode, version)


def _push(learner, url: str, layout: str, adapter_dir: Path) -> dict:
    """Push the trained learner to the embedded server over the broadcast group (`lora_mode`
    adapter or merged); rank 0 then probes the server: the version it reports and the gap between
    its log-probs and a single-process PEFT model's with the exported adapter, and the base's."""
    from peft import PeftModel

    from agentrl.config import BroadcastSyncConfig, InferenceConfig
    from agentrl.learner.fsdp import load_model
    from agentrl.weight_sync.base import pushed_adapter
    from agentrl.weight_sync.registry import create
    from tests.integration.test_lora_sync import gap, learner_logprobs, probe

    mode, version = PUSHES[layout]
    spec = pushed_adapter(learner.cfg.lora, mode, learner.cfg.model_path)
    engine = create(BroadcastSyncConfig(timeout_s=60, lora_mode=mode), InferenceConfig(servers=[url]),
                    rank=learner.rank, adapter=spec)  # fmt: skip
    engine.init()
    try:
        stats = engine.push(learner.weights(), version)
    finally:
        engine.close()
    if learner.rank != 0:
        return {}
    served_version, output_ids, served, _ = probe(url)
    peft = PeftModel.from_pretrained(load_model(learner.cfg.model_path, learner.device), adapter_dir).eval()
    return {"updated": stats.servers_updated, "tensors": stats.tensors, "served_version": served_version,
            "gap": gap(served, learner_logprobs(peft, output_ids)),
            "base_gap": gap(served, learner_logprobs(peft, output_ids, adapter=False))}  # fmt: skip


def worker(out_dir: str, model_path: str, url: str) -> None:
    import torch

    from agentrl.learner.data import prepare_batch
    from agentrl.learner.fsdp import load_model
    from agentrl.learner.hf_model import forward_logprobs
    from agentrl.learner.loop import build_learner, run
    from agentrl.learner.packing import plan_microbatches
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    samples = prepare_batch(make_groups(3, seed=11, max_len=60), advantage="rloo", loss_agg="seq_mean_token_mean",
                            vocab_size=1024, learner_version=0).mini_batches[0]  # fmt: skip
    mb = plan_microbatches(samples, 4096, pad_id=817)[0]
    base_logp = forward_logprobs(load_model(model_path, torch.device("cpu")).eval(), mb)[0].detach()
    init, results = None, {}
    for layout, sizes in LAYOUTS.items():
        extra = {"backend": "fsdp2"}
        if sizes is not None:
            extra = {"backend": "megatron", "megatron": {"tp": sizes[0], "pp": sizes[1]}}
        extra["activation_checkpointing"] = layout == "tp2"  # Megatron's full-layer recompute
        learner = build_learner(
            learner_config(model_path=model_path, **CONFIG, **extra), Path(out_dir) / layout
        )
        if init is None:  # PEFT's A; B random, the same on every rank
            gen = torch.Generator().manual_seed(7)
            init = {n: t.clone() if ".lora_A." in n else 0.05 * torch.randn(t.shape, generator=gen)
                    for n, t in learner.backend.adapter_tensors(learner.actor)}  # fmt: skip
            peft_logp = _peft_logprobs(model_path, init, mb)
        _set_adapter(learner, init)
        trained = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
        result = {"optimizer_tensors": len(trained),
                  "only_adapters": all(p.requires_grad == (id(p) in trained) for p in learner.model.parameters())}  # fmt: skip
        with learner.backend.frozen(learner.actor):
            result["logp_diff"] = float(
                (learner.backend.logprobs(learner.actor, mb)[0] - peft_logp).abs().max()
            )
        with learner.backend.frozen(learner.ref):
            result["ref_logp_diff"] = float(
                (learner.backend.logprobs(learner.ref, mb)[0] - base_logp).abs().max()
            )
        metrics = Metrics()
        source = ListSource(make_groups(3, seed=11, max_len=60)) if learner.rank == 0 else None
        run(learner, source, max_staleness=4, metrics=metrics)  # one step, then the final export
        with learner.backend.frozen(learner.actor):
            trained_logp = learner.backend.logprobs(learner.actor, mb)[0]
        pushed = learner.weights()
        adapter = {n: t.clone() for n, t in pushed()}
        merged = {n: t.clone() for n, t in pushed.merged()}
        if layout == "tp2":
            result["resumed_equal"] = _resumed_equal(learner, adapter)
        if layout in PUSHES:
            result["push"] = _push(learner, url, layout, Path(out_dir) / layout / "adapter" / "latest")
        if learner.rank == 0:
            exported = _peft_logprobs(model_path, Path(out_dir) / layout / "adapter" / "latest", mb)
            result["exported_logp_diff"] = float((exported - trained_logp).abs().max())
            torch.save({"init": init, "adapter": adapter, "merged": merged}, Path(out_dir) / f"{layout}.pt")
            step = metrics.rows[-1]
            result |= {k: step[k] for k in ("loss", "grad_norm", "kl_ref")}
            results[layout] = result
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps(results))
    end_rank()


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory) -> tuple[Path, dict]:
    """The worker's results, with one embedded server (`agentrl serve`) for its pushes."""
    from tests.integration.test_weight_sync import wait_healthy

    out = tmp_path_factory.mktemp("megatron_lora")
    procs, port = Processes(), find_free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with open(out / "server.log", "wb") as log:
            procs.agentrl("serve", "--model", str(tiny_model), "--port", str(port), stdout=log, stderr=log)
        wait_healthy([url])
        run_torchrun(__file__, 2, str(out), str(tiny_model), url, timeout=600)
    finally:
        procs.stop_all()
    return out, json.loads((out / "result.json").read_text())


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_megatron_lora_matches_peft_on_fsdp2(two_ranks, layout):
    import torch

    out, results = two_ranks
    got, ref = results[layout], results["fsdp2"]
    layers = 2  # rank 0's: all of them, or its pipeline stage's half
    assert got["optimizer_tensors"] == 2 * 7 * layers // LAYOUTS[layout][1]  # A and B of 7 Linears a layer
    assert ref["optimizer_tensors"] == 2 * 7 * layers
    assert got["only_adapters"] and ref["only_adapters"]
    assert got["logp_diff"] < 1e-5 and ref["logp_diff"] < 1e-5  # vs the single-process PEFT model
    assert got["ref_logp_diff"] < 1e-5 and ref["ref_logp_diff"] < 1e-5  # adapter off: the base HF model
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert ref["kl_ref"] > 0 and got["kl_ref"] == pytest.approx(ref["kl_ref"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    mine, fsdp = torch.load(out / f"{layout}.pt"), torch.load(out / "fsdp2.pt")
    assert mine["adapter"].keys() == fsdp["adapter"].keys() == mine["init"].keys()
    for name in fsdp["adapter"]:
        a, b = mine["adapter"][name], fsdp["adapter"][name]
        assert float((a - b).norm() / b.norm()) < 1e-5, name  # 5e-7 measured
        # elementwise: where a gradient is ~0, Adam's m/sqrt(v) turns float reduction-order noise
        # into a fraction of the lr 1e-3 step (up to 6e-7 measured); elsewhere ~1e-8
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(a, mine["init"][name]), name  # A and B both trained
    assert mine["merged"].keys() == fsdp["merged"].keys()
    for name in fsdp["merged"]:
        torch.testing.assert_close(mine["merged"][name], fsdp["merged"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert got["exported_logp_diff"] < 1e-5 and ref["exported_logp_diff"] < 1e-5


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(PUSHES))
def test_megatron_lora_pushes_serve_the_trained_adapter(two_ranks, layout):
    """TP 2's adapter push (lora_mode adapter: its 28 lora_A / lora_B tensors) and PP 2's merged
    push (the full-weight path) into the embedded server: it reports the version and serves what
    PEFT computes with the exported adapter, not the base."""
    _, results = two_ranks
    push = results[layout]["push"]
    assert push["updated"] == 1 and push["served_version"] == PUSHES[layout][1]
    if PUSHES[layout][0] == "adapter":
        assert push["tensors"] == 2 * 7 * 2
    assert push["gap"] < 1e-4 and push["base_gap"] > 1e-3


@pytest.mark.integration
def test_megatron_lora_checkpoint_resumes_the_adapter(two_ranks):
    _, results = two_ranks
    assert results["tp2"]["resumed_equal"]


if __name__ == "__main__":
    worker(*sys.argv[1:4])
