"""`learner.lora` on the FSDP2 learner (one rank, a real gloo group), with PEFT itself as the
oracle: only the adapter trains and sits in the optimizer, the KL reference is the base model
(the adapter disabled, no second copy), a wrong `target_modules` is refused naming the entry,
exports load with `PeftModel.from_pretrained` and give the learner's log-probs, the merged export
equals base + adapter, and a resumed run ends on the same adapter and optimizer state as a
straight one."""

import pytest
import torch

pytest.importorskip("peft")

from agentrl.learner.fsdp import full_state_dict
from agentrl.learner.loop import build_learner, run
from agentrl.log import MetricsLogger, read_metrics
from tests.unit.learner.source import ListSource, learner_config, make_groups

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _cfg(tiny_model, **kw):
    base = dict(model_path=str(tiny_model), groups_per_step=2, max_steps=3, micro_batch_tokens=64, lr=1e-2,
                batch_timeout_s=0.1, lora=LORA)  # fmt: skip
    return learner_config(**{**base, **kw})


def _state(learner):
    return {k: v.clone() for k, v in full_state_dict(learner.model).items()}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model, tmp_path):
    lora = {**LORA, "export_merged": True}
    learner = build_learner(_cfg(tiny_model, kl_coef=0.1, kl_estimator="k3", lora=lora), tmp_path)
    trained = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    names = [n for n, p in learner.model.named_parameters() if id(p) in trained]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    assert len(names) == 2 * 3 * learner.model.config.num_hidden_layers  # A and B of 3 targets per layer
    assert learner.ref is not None and learner.ref.module.peft_model is learner.model  # no second copy
    before = _state(learner)

    metrics = MetricsLogger(tmp_path)
    run(learner, ListSource(make_groups(6, seed=1)), max_staleness=1, metrics=metrics)
    metrics.close()
    after = _state(learner)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(".lora_" in k for k in changed), changed
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the adapter starts as the base
    assert rows[-1]["kl_ref"] > 0  # the policy moved away from the reference

    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.testing.assert_close(_logits(learner.ref.module, ids), _logits(base, ids), rtol=0, atol=1e-5)
    ours = _logits(learner.model, ids)
    assert (ours - _logits(base, ids)).abs().max() > 1e-4  # the adapter changes the policy

    from peft import PeftModel

    adapter_dir = tmp_path / "adapter" / "latest"
    assert (adapter_dir / "adapter_config.json").is_file()
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(_logits(loaded, ids), ours, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "latest", dtype=torch.float32)
    torch.testing.assert_close(_logits(merged, ids), ours, rtol=0, atol=1e-4)


def test_a_target_module_the_model_lacks_is_refused_by_name(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, lora={**LORA, "target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(ValueError, match="'qkv_proj' matches no Linear module"):
        build_learner(cfg, tmp_path)


def test_adapter_weights_are_the_adapter_and_merged_is_base_plus_adapter(tiny_model, tmp_path):
    from agentrl.weight_sync.base import AdapterWeights, resolve

    learner = build_learner(_cfg(tiny_model), tmp_path)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if ".lora_B." in name:
                p.to_local().normal_(0, 0.1) if hasattr(p, "to_local") else p.normal_(0, 0.1)
    weights = learner.weights()
    assert isinstance(weights, AdapterWeights)
    source, spec = resolve(weights, "adapter")
    adapter = dict(source())
    assert spec.r == 4 and set(spec.target_modules) == {"q_proj", "v_proj", "down_proj"}
    assert all(
        n.startswith("base_model.model.") and (".lora_A.weight" in n or ".lora_B.weight" in n)
        for n in adapter
    )
    source, spec = resolve(weights, "merged")
    assert spec is None
    merged = dict(source())
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    torch.testing.assert_close(_logits(plain, ids), _logits(learner.model, ids), rtol=0, atol=1e-5)


def test_resume_gives_the_same_adapter_as_a_straight_run(tiny_model, tmp_path):
    groups = make_groups(8, seed=3)
    straight = build_learner(_cfg(tiny_model, max_steps=4), tmp_path / "straight")
    run(straight, ListSource(groups), max_staleness=1)
    expected = _state(straight)

    first = build_learner(_cfg(tiny_model, max_steps=2), tmp_path / "resumed")
    run(first, ListSource(groups), max_staleness=1)
    # the checkpoint holds the adapter only (the base comes from model_path), and in PEFT's format too
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = tmp_path / "resumed" / "checkpoints" / "step_00000002"
    keys = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), [k for k in weights if ".lora_" not in k]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, saved / "actor_adapter").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    first.model.eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(first.model, ids), rtol=0, atol=1e-5)
    second = build_learner(_cfg(tiny_model, max_steps=4), tmp_path / "resumed")
    source = ListSource(groups)
    assert run(second, source, max_staleness=1, resume_from_checkpoint=True) == 4
    assert source.versions[0] == 2
    got = _state(second)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name  # bit-identical
    straight_opt, resumed_opt = (
        straight.optimizer.state_dict()["state"],
        second.optimizer.state_dict()["state"],
    )
    assert resumed_opt.keys() == straight_opt.keys()
    for key, state in straight_opt.items():
        for field in ("exp_avg", "exp_avg_sq"):
            a, b = state[field], resumed_opt[key][field]
            a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
            assert torch.equal(a, b), (key, field)


def test_lora_settings_the_run_cannot_honour_are_refused_up_front():
    from agentrl.config import AgentRLConfig

    lora = {**LORA, "modules_to_save": ["lm_head"]}
    with pytest.raises(ValueError, match="lora_mode: merged"):
        AgentRLConfig(learner={"lora": lora})
    AgentRLConfig(learner={"lora": lora}, weight_sync={"lora_mode": "merged"})
    AgentRLConfig(learner={"lora": LORA}, mode="colocated")  # adapters on whole colocated replicas
    with pytest.raises(ValueError, match=r"colocated.t=2, colocated.tg=1: adapters are trained and served"):
        AgentRLConfig(learner={"lora": LORA}, mode="colocated", colocated={"t": 2})
    with pytest.raises(ValueError, match=r"colocated.t=1, colocated.tg=2"):
        AgentRLConfig(learner={"lora": LORA}, mode="colocated", colocated={"tg": 2})
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\] with mode: colocated"):
        AgentRLConfig(learner={"lora": lora}, mode="colocated", weight_sync={"lora_mode": "merged"})
    AgentRLConfig(learner={"lora": LORA}, mode="colocated", weight_sync={"lora_mode": "merged"})
    with pytest.raises(ValueError, match=r"'merged' with mode: colocated and colocated\.num_processes: 1"):
        AgentRLConfig(learner={"lora": LORA}, mode="colocated", colocated={"num_processes": 1},
                      weight_sync={"lora_mode": "merged"})  # fmt: skip
    with pytest.raises(
        ValueError, match=r"colocated trains adapters on learner.backend fsdp2 only, not megatron"
    ):
        AgentRLConfig(learner={"lora": LORA, "backend": "megatron"}, mode="colocated")
    AgentRLConfig(learner={"lora": LORA, "backend": "megatron"})  # decoupled Megatron + LoRA
