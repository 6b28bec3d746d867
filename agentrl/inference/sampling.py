"""Per-request sampling for the embedded server, with the log-prob of what was sampled.

RL needs the behaviour log-probability of every generated token. Here it is the
log-probability under the distribution the token was actually drawn from: logits divided
by the request's temperature, then restricted by top-k / top-p / min-p and renormalised.
With temperature 1 and no truncation this is the model's plain `log_softmax`, which a test
checks against a fresh forward pass. Greedy rows (temperature 0) report the untempered
log-prob of the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """The subset of SGLang's `sampling_params` the embedded server implements."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    sampling_seed: int | None = None


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Set to -inf every logit outside each row's top-k / top-p / min-p set (the argmax always stays)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    remove = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    remove |= before > top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 `logits` [B, V]; return (tokens [B], logprobs [B])."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
    if bool((top_k > 0).any() | (top_p < 1).any() | (min_p > 0).any()):
        scaled = _truncate(scaled, top_k, top_p, min_p)
    logp = scaled.log_softmax(dim=-1)
    probs = logp.exp()
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=device)
        tokens[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
    for i in seeded:
        tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i]).squeeze()
    if bool(greedy.any()):
        raw = logits.log_softmax(dim=-1)
        arg = logits.argmax(dim=-1)
        tokens = torch.where(greedy, arg, tokens)
        logp = torch.where(greedy[:, None], raw, logp)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
