"""The Megatron backend's checkpoints and exports (`MegatronBackend.save` / `load` / `export` call
these): a resumable checkpoint is one file per (TP, PP) coordinate, written by data-parallel rank
0, so resuming needs the same tp and pp (any data-parallel size); a LoRA actor's holds only its
adapters and their AdamW state, plus a PEFT adapter directory. An export is a plain HF
checkpoint of the weights gathered over TP and the pipeline stages.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agentrl.learner import hf_model
from agentrl.learner import lora as lora_io
from agentrl.learner.backend import ModelPart
from agentrl.learner.fsdp import copy_tokenizer

if TYPE_CHECKING:
    from agentrl.learner.megatron import MegatronBackend
    from agentrl.learner.megatron_model import MegatronModel


def shard_file(backend: MegatronBackend, path: Path) -> Path:
    return path / f"megatron_tp{backend.tp_rank}_pp{backend.pp_rank}.pt"


def trained_state(module: MegatronModel) -> dict[str, Any]:
    """What a checkpoint holds of a model: its whole state dict, or a LoRA model's adapters."""
    if module.lora is None:
        return module.gpt.state_dict()
    return {n: p.detach() for n, p in module.gpt.named_parameters() if n in module.adapter_names}


def save(backend: MegatronBackend, parts: list[ModelPart], path: Path) -> None:
    """Each (TP, PP) shard's weights and AdamW state, written by its data-parallel rank 0. A
    LoRA actor saves its adapters only (the base comes from `learner.model_path` at every
    start), and also as a PEFT adapter directory `<name>_adapter/`."""
    path.mkdir(parents=True, exist_ok=True)
    if backend.dp_rank == 0:
        state = {"tp": backend.tp, "pp": backend.pp}
        for part in parts:
            state[part.name] = {
                "model": trained_state(part.module),
                "optim": part.optimizer.state_dict(),
            }
        with open(shard_file(backend, path), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    for part in parts:
        if part.module.lora is not None:
            tensors = dict(backend.adapter_tensors(part))  # a collective
            if backend.rank == 0:
                lora_io.write_adapter(path / f"{part.name}_adapter", tensors, part.module.lora,
                                      part.module.base_path)  # fmt: skip
    dist.barrier()


def load(backend: MegatronBackend, parts: list[ModelPart], path: Path) -> None:
    tp, pp = backend.tp, backend.pp
    file = shard_file(backend, path)
    if not file.exists():
        raise FileNotFoundError(f"{file}: no shard for tp {tp} x pp {pp}; resume with the "
                                "learner.megatron tp and pp the checkpoint was written with")  # fmt: skip
    state = torch.load(file, weights_only=False, map_location=backend.device)
    if (state["tp"], state["pp"]) != (tp, pp):
        raise ValueError(f"{path}: written with tp {state['tp']} x pp {state['pp']}, this learner is "
                         f"tp {tp} x pp {pp}")  # fmt: skip
    for part in parts:
        saved, wanted = state[part.name]["model"], trained_state(part.module)
        if saved.keys() != wanted.keys():
            missing, extra = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
            raise ValueError(f"{path}: the {part.name}'s saved tensors differ from this model's (missing "
                             f"{missing[:3]}, unexpected {extra[:3]}): learner.lora must match the run's")  # fmt: skip
        part.module.gpt.load_state_dict(saved, strict=part.module.lora is None)
        part.optimizer.load_state_dict(state[part.name]["optim"])


def export(
    backend: MegatronBackend, part: ModelPart, out_dir: Path, tokenizer_path: str | Path | None
) -> Path:
    """A plain HF checkpoint (safetensors, config, tokenizer) of the gathered weights (a value
    model: a one-label `AutoModelForTokenClassification`, as the FSDP2 backend's critic)."""
    state = {name: tensor.cpu() for name, tensor in backend.full_tensors(part)}
    out = Path(out_dir)
    if backend.rank == 0:
        config = copy.deepcopy(part.module.config)
        if part.kind == "value":
            config.num_labels = 1
        hf_model.save_plain(state, config, part.kind, out)
        if tokenizer_path is not None:
            copy_tokenizer(Path(tokenizer_path), out)
    dist.barrier()
    return out
