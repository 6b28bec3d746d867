"""LoRA adapters on the embedded server's model, through PEFT (the learner's library, so the
server's forward is the learner's op for op).

The first adapter injects PEFT's LoRA layers into the served model
(`peft.inject_adapter_in_model`, dropout 0); each adapter version then only refills their A and B
matrices. Prefill runs the model's forward, whose LoRA layers add `scaling · B(A(x))` to each
adapted Linear; the lean Qwen2 decode step calls those layers too (`decode.linear`). An adapter
arrives as PEFT's saved tensors (`base_model.model.<module>.lora_A.weight`, as
`get_peft_model_state_dict` names them) with its config (`r`, `lora_alpha`, `target_modules`, the
name it is served under), over the broadcast group (admin `/begin_weight_update` with `lora`) or as
a PEFT adapter directory (`/load_lora_adapter`). Every load is checked whole before anything is
copied: a refused adapter leaves the served one and its version in place. In colocated mode
(agentrl/colocated/loop.py) the layers are injected before the engine starts and the HybridEngine
refills their A and B in place at each reshard, with no `load` (with `lora_mode: merged` it
refills the base too and `merge_refilled` folds the adapter into it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER = "default"  # PEFT's adapter name inside the served model
PEFT_PREFIX = "base_model.model."


def module_name(saved: str) -> str:
    """The served model's parameter name of a PEFT saved tensor name."""
    name = saved[len(PEFT_PREFIX) :] if saved.startswith(PEFT_PREFIX) else saved
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return name


def _targets(config: dict[str, Any]) -> tuple[int, float, tuple[str, ...]]:
    try:
        return int(config["r"]), float(config["lora_alpha"]), tuple(sorted(config["target_modules"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"adapter config needs r, lora_alpha and target_modules: {exc!r}") from exc


class ServedAdapter:
    """The adapter state of one served model: what is injected, and under which name."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.injected: tuple[int, float, tuple[str, ...]] | None = None
        self.name: str | None = None
        self._maps: tuple[dict[str, nn.Module], dict[str, nn.Parameter]] | None = None

    def _modules_and_params(self) -> tuple[dict[str, nn.Module], dict[str, nn.Parameter]]:
        """{name: module} and {name: parameter} of the model, walked once per injection (a model with
        LoRA layers has thousands of modules: each walk costs ~1.5 ms at every adapter push). Only
        `inject` changes the module tree; a load rebinds no parameter object."""
        if self._maps is None:
            self._maps = dict(self.model.named_modules()), dict(self.model.named_parameters())
        return self._maps

    def inject(self, config: dict[str, Any]) -> None:
        """PEFT's LoRA layers on the model, once; a later adapter must have the same shape."""
        wanted = _targets(config)
        if self.injected is not None:
            if wanted != self.injected:
                raise ValueError(
                    f"adapter r/alpha/target_modules {wanted} differ from the served adapter's {self.injected}; "
                    "restart the server to serve another adapter layout"
                )
            return
        from peft import LoraConfig, inject_adapter_in_model

        r, alpha, targets = wanted
        config = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none"
        )
        inject_adapter_in_model(config, self.model, adapter_name=ADAPTER)
        self.model.eval()
        self.injected, self._maps = wanted, None

    def check(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Raise ValueError when `tensors` are not exactly the adapter `config` describes on this
        model: names of modules the model lacks or no target names, shapes other than r's."""
        r, _, targets = _targets(config)
        modules, _ = self._modules_and_params()
        problems = []
        for saved, tensor in tensors.items():
            base, _, part = saved.removesuffix(".weight").rpartition(".")
            owner = base[len(PEFT_PREFIX) :] if base.startswith(PEFT_PREFIX) else base
            linear = modules.get(owner)
            linear = getattr(linear, "base_layer", linear)
            if part not in ("lora_A", "lora_B") or not isinstance(linear, nn.Linear):
                problems.append(f"{saved}: not a lora_A/lora_B of a Linear module of the model")
                continue
            if not any(owner == t or owner.endswith("." + t) for t in targets):
                problems.append(f"{saved}: {owner} is not in target_modules {list(targets)}")
            want = (r, linear.in_features) if part == "lora_A" else (linear.out_features, r)
            if tuple(tensor.shape) != want:
                problems.append(f"{saved}: shape {list(tensor.shape)}, expected {list(want)}")
        if not tensors:
            problems.append("no adapter tensors")
        if problems:
            raise ValueError("; ".join(problems[:5]) + (" …" if len(problems) > 5 else ""))

    def load(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Check, inject on first use, check that every adapted Linear gets both matrices, copy."""
        self.check(tensors, config)
        self.inject(config)
        _, params = self._modules_and_params()
        wanted = {n for n in params if f".lora_A.{ADAPTER}." in n or f".lora_B.{ADAPTER}." in n}
        given = {module_name(n): t for n, t in tensors.items()}
        missing = sorted(wanted - given.keys())
        if missing:
            raise ValueError(f"adapter lacks {len(missing)} of the model's LoRA tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, tensor in given.items():
                target = params[name]
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.name = str(config.get("name") or "adapter")

    def merge_refilled(self) -> None:
        """Fold every LoRA layer's `scaling · B @ A` into its base weight, which was just refilled
        with the unmerged base (a colocated reshard with `lora_mode: merged`), and serve that
        (PEFT's `merge`: the layer then runs its base Linear alone); what a layer merged before the
        refill is forgotten."""
        from peft.tuners.lora import LoraLayer

        if self.injected is None:
            raise RuntimeError("merge_refilled: no LoRA layers injected")
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    module.merged_adapters.clear()
                    module.merge(adapter_names=[ADAPTER])

    def base_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full weights under the plain model's names, renamed to the injected model's (an adapted
        Linear's weight is its `base_layer`'s)."""
        if self.injected is None:
            return tensors
        _, params = self._modules_and_params()
        renamed = {}
        for name, tensor in tensors.items():
            owner, _, leaf = name.rpartition(".")
            inner = f"{owner}.base_layer.{leaf}"
            renamed[inner if name not in params and inner in params else name] = tensor
        return renamed

    def clear(self) -> None:
        """Serve the base alone (B = 0 in every LoRA layer): full weights replaced the adapter."""
        if self.injected is None:
            return
        with torch.no_grad():
            for name, param in self._modules_and_params()[1].items():
                if f".lora_B.{ADAPTER}." in name:
                    param.zero_()
        self.name = None


def read_adapter_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config) of a PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`)."""
    from safetensors.torch import load_file

    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{root} is not a PEFT adapter directory: no {f.name}")
    config = json.loads(config_file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(
            f"{config_file}: peft_type {config.get('peft_type')!r}, the server applies LORA only"
        )
    return load_file(str(weights_file)), config
