"""The Hugging Face models a learner backend runs, and what it reads off their outputs: the
policy's log-prob of each target token (and its entropy), the value head's value per position.

Backend-side code: `fsdp.py` (and any backend running HF modules) calls these; the algorithm
(`train_step`, `critic`, `losses`) reaches them only through the backend's `logprobs` / `values`,
and nothing here imports the algorithm.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.learner.packing import MicroBatch
from agentrl.moe import replay_routing, routing_shape

ENTROPY_METRIC_STRIDE = 8


def forward_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float = 1.0, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token (flat [rows·T], 0 where nothing is trained) and the entropy.

    Only positions that predict a loss token go through the vocabulary softmax (prompt and tool
    output positions are skipped). `entropy`: "grad" computes it on every loss token as part of
    the loss; "metric" estimates its mean from every ENTROPY_METRIC_STRIDE-th loss token, without
    gradient (unsampled positions hold NaN); "none" skips it.

    A micro-batch with `routed_experts` (MoE router replay) routes each token to its recorded experts
    (agentrl/moe.py `replay_routing`; tokens without a record keep the model's own routing)."""
    replay = contextlib.nullcontext()
    if mb.routed_experts is not None:
        shape = routing_shape(model)
        if shape is None:
            raise ValueError(f"router replay: {type(model).__name__} is not a mixture-of-experts model")
        if mb.routed_experts.shape[1] != shape[0] * shape[1]:
            raise ValueError(
                f"router replay: {mb.routed_experts.shape[1]} recorded experts per token, the model's "
                f"{shape[0]} MoE layers × top-{shape[1]} need {shape[0] * shape[1]} (vLLM records every "
                "hidden layer: a model with dense layers among its MoE ones does not fit)"
            )
        replay = replay_routing(model, mb.routed_experts.view(mb.routed_experts.shape[0], *shape))
    with replay:
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=mb.attention_mask,
            use_cache=False,
        )
    return logprobs_from_logits(out.logits, mb, temperature, entropy)


def logprobs_from_logits(
    logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_logprobs` from the full-vocabulary logits [rows, T, V] a backend computed."""
    logits = logits.reshape(-1, logits.shape[-1])
    where = mb.mask.nonzero().squeeze(-1)
    picked = logits[where].float()
    if temperature != 1.0:
        picked = picked / temperature
    logp_picked = -F.cross_entropy(picked, mb.targets[where], reduction="none")
    logp = logp_picked.new_zeros(logits.shape[0]).index_put((where,), logp_picked)
    ent = None
    if entropy == "grad":
        ent = logp.new_zeros(logp.shape).index_put((where,), entropy_from_logits(picked))
    elif entropy == "metric":
        with torch.no_grad():
            rows = torch.arange(0, where.numel(), ENTROPY_METRIC_STRIDE)
            sampled = entropy_from_logits(picked.detach()[rows])
            ent = torch.full_like(logp, float("nan"), requires_grad=False).index_put((where[rows],), sampled)
    return logp, ent


def load_value_model(path: str | Path, device: torch.device) -> nn.Module:
    """The checkpoint's decoder with a scalar head in fp32: zero-initialised, unless the
    checkpoint is a one-label token classifier already (an exported critic). No dropout before
    the head (HF's token classifier defaults to 0.1): the values trained against are those the
    frozen forward computed as the clip centre (as TRL disables dropout in its value model)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    architectures = AutoConfig.from_pretrained(str(path)).architectures or []
    is_critic = any(a.endswith("ForTokenClassification") for a in architectures)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were newly initialised": the head, on purpose
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, dtype=torch.float32, attn_implementation="sdpa"
        )
    finally:
        hf_logging.set_verbosity(level)
    model.config.use_cache = False
    model.config.classifier_dropout = 0.0
    model.dropout.p = 0.0
    if not is_critic:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model.to(device)


def values(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """V at every position of the micro-batch, flat [rows·T], in fp32."""
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)
    return out.logits.reshape(-1).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution of each row of logits."""
    logz = torch.logsumexp(logits, dim=-1)
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def save_plain(state: dict[str, torch.Tensor], config, kind: str, out: Path) -> None:
    """Write `state` (full tensors under HF names) as a plain HF checkpoint in `out`: a causal LM,
    or with `kind="value"` a one-label `AutoModelForTokenClassification` (the critic), built on the
    meta device and filled by assignment (no copy of the weights), ties restored, safetensors."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForCausalLM if kind == "policy" else AutoModelForTokenClassification
    with torch.device("meta"):
        plain = auto.from_config(config)
    plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()
    plain.config.use_cache = True
    plain.save_pretrained(out, safe_serialization=True)
