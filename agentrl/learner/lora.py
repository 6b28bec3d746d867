"""LoRA adapters on the learner's policy (`learner.lora`), through PEFT.

    learner:
      lora: {rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj]}

The FSDP2 backend wraps the loaded model with PEFT's `get_peft_model` before sharding it: the base
weights are frozen, only the adapter's (and `modules_to_save`'s) parameters train and sit in the
optimizer. The KL reference is the same module with its adapter disabled (`AdapterDisabled`), so a
LoRA run holds one copy of the base weights. A `target_modules` entry that names no module of the
model is refused before anything trains, naming the entry (`check_targets`). The Megatron backend
keeps its own adapters on its tensor-parallel layers (`megatron_lora.py`) and emits the same
names and files (the config, the names and `write_adapter` / `write_merged` are shared).

What leaves the learner (weight sync, checkpoints' exports) is PEFT's format: the adapter's tensors
under the names `get_peft_model_state_dict` gives them (`base_model.model.<module>.lora_A.weight`)
and an `adapter_config.json`, as `PeftModel.save_pretrained` writes; or, with
`weight_sync.lora_mode: merged` and `lora.export_merged`, base + adapter merged into plain HF
weights (`merged_tensors`). The torch and PEFT imports are inside the functions: the config
loads without them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from agentrl.learner.sharded import full, reshard_units
from agentrl.section import Section

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"  # PEFT's adapter name on the learner's model
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's names


class LoraConfig(Section):
    """Train LoRA adapters instead of the full policy (`pip install 'agentrl[lora]'`; FSDP2 through
    PEFT, Megatron through `megatron_lora.py` in PEFT's layout)."""

    rank: int = Field(8, ge=1)
    """The adapters' rank r."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (none in the reference, the log-prob
    recomputation or the servers: they run in eval mode)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Linear modules that get an adapter, as PEFT matches them: a name equal to a module's full
    name or to its last dotted parts (`q_proj` matches every layer's `self_attn.q_proj`). Each must
    match a module of the model."""
    modules_to_save: list[str] | None = None
    """Modules trained in full beside the adapters (e.g. `[lm_head]`); they travel with the adapter
    in checkpoints and exports. Servers get them only with `weight_sync.lora_mode: merged`. FSDP2
    backend only."""
    export_merged: bool = False
    """Exports (`checkpoint.export_every` and the final one) also write base + adapter merged into a
    plain HF checkpoint under `<run_dir>/hf_merged/`."""


def peft_config(cfg: LoraConfig) -> Any:
    """PEFT's `LoraConfig` for `cfg` (a causal-LM task)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def matches(module_name: str, target: str) -> bool:
    """PEFT's rule for one `target_modules` string: the full name or its dotted suffix."""
    return module_name == target or module_name.endswith("." + target)


def check_targets(model: nn.Module, cfg: LoraConfig) -> None:
    """Raise ValueError naming each `target_modules` entry that matches no Linear module of `model`
    (and each `modules_to_save` entry that matches no module), before PEFT wraps anything."""
    from torch import nn

    named = list(model.named_modules())
    linear = [name for name, m in named if isinstance(m, nn.Linear)]
    problems = []
    for target in cfg.target_modules:
        if not any(matches(name, target) for name in linear):
            near = sorted({name.rsplit(".", 1)[-1] for name in linear})
            problems.append(f"target_modules entry {target!r} matches no Linear module (the model's: {near})")
    for target in cfg.modules_to_save or []:
        if not any(matches(name, target) for name, _ in named if name):
            problems.append(f"modules_to_save entry {target!r} matches no module of the model")
    if problems:
        raise ValueError(f"learner.lora: {'; '.join(problems)}")


def apply(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`model` wrapped by PEFT with a fresh adapter (B = 0: the wrapped model computes what the base
    does); base parameters frozen. The targets are checked first (`check_targets`)."""
    from peft import get_peft_model

    check_targets(model, cfg)
    return get_peft_model(model, peft_config(cfg), adapter_name=ADAPTER)


class AdapterDisabled:
    """The KL reference of a LoRA actor: calls the actor's PEFT model with its adapter disabled
    (`PeftModel.disable_adapter`), so the reference is the base model without a second copy.
    Not an `nn.Module`: it owns no parameters, and `train` / `eval` reach the actor's module."""

    def __init__(self, peft_model: nn.Module) -> None:
        self.peft_model = peft_model

    def __call__(self, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.peft_model(**kwargs)

    @property
    def training(self) -> bool:
        return self.peft_model.training

    def train(self, mode: bool = True) -> AdapterDisabled:
        self.peft_model.train(mode)
        return self

    def eval(self) -> AdapterDisabled:
        return self.train(False)

    @property
    def config(self) -> Any:
        return self.peft_model.config


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def saved_name(param_name: str) -> str | None:
    """The name PEFT saves a trained parameter under (`get_peft_model_state_dict`: the adapter name
    dropped), or None for a parameter of the base model."""
    if f".lora_A.{ADAPTER}." in param_name or f".lora_B.{ADAPTER}." in param_name:
        return param_name.replace(f".{ADAPTER}.", ".")
    if f".modules_to_save.{ADAPTER}." in param_name:
        return param_name.replace(f".modules_to_save.{ADAPTER}.", ".")
    return None


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT saved name, full tensor) of every adapter parameter (lora_A / lora_B; with
    `modules_to_save`, those modules' parameters too), gathered one at a time: a collective, every
    rank iterates to the end. The base weights are not gathered."""
    reshard_units(model)
    for name, param in model.named_parameters():
        saved = saved_name(name)
        if saved is not None:
            yield saved, full(param)


def lora_only(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The lora_A / lora_B tensors of `adapter_tensors` (what servers that load adapters take)."""
    for name, tensor in named:
        if ".lora_A." in name or ".lora_B." in name:
            yield name, tensor


def merged_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of base + adapter merged, as the plain model's `named_parameters`
    would give them (W + scaling · B @ A for each adapted Linear; `modules_to_save` modules' trained
    copies in place of the originals): what a server without LoRA support loads. A collective."""
    reshard_units(model)
    lora_modules = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {})
    }
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue  # the same on every rank: the gathers stay in step
        tensor = full(param)
        owner, _, leaf = name.rpartition(".")
        module = (
            lora_modules.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        )
        if module is not None and leaf == "weight":
            a = full(module.lora_A[ADAPTER].weight)
            b = full(module.lora_B[ADAPTER].weight)
            tensor = tensor + (b @ a) * module.scaling[ADAPTER]
        yield hf_name(name), tensor


def hf_name(param_name: str) -> str:
    """The plain model's name of a parameter of the PEFT-wrapped model."""
    name = param_name[len(PEFT_PREFIX) :] if param_name.startswith(PEFT_PREFIX) else param_name
    name = name.replace(".base_layer.", ".")
    return re.sub(rf"\.modules_to_save\.{ADAPTER}\.", ".", name)


def adapter_config(cfg: LoraConfig, base_model: str) -> dict[str, Any]:
    """`adapter_config.json` as PEFT writes it for this adapter."""
    config = peft_config(cfg)
    config.base_model_name_or_path = base_model
    return config.to_dict()


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str) -> Path:
    """A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`), loadable with
    `PeftModel.from_pretrained`; files written under temporary names and renamed."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = adapter_config(cfg, base_model)
    config["peft_type"] = str(getattr(config["peft_type"], "value", config["peft_type"]))
    config["task_type"] = str(getattr(config["task_type"], "value", config["task_type"]))
    config["target_modules"] = sorted(config["target_modules"])
    tmp = out / "adapter_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True, default=list))
    tmp.rename(out / "adapter_config.json")
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / "adapter_model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "adapter_model.safetensors.tmp").rename(out / "adapter_model.safetensors")
    return out


def write_peft_dir(out: Path, tensors: dict[str, torch.Tensor], peft_model: nn.Module) -> Path:
    """`write_adapter` from the PEFT model's own config (what a checkpoint holds)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[ADAPTER].save_pretrained(str(out))
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def write_merged(out: Path, state: dict[str, torch.Tensor], model: nn.Module) -> Path:
    """A plain HF checkpoint of base + adapter merged (`merged_tensors`), as `export_hf` writes one."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=False, assign=True)
    plain.tie_weights()
    plain.config.use_cache = True
    plain.save_pretrained(out, safe_serialization=True)
    return out
