"""Per-request sampling for the embedded server, with the log-prob of what was sampled.

RL needs the behaviour log-probability of every generated token. Tokens are drawn from the
logits divided by the request's temperature, restricted by top-k / top-p / min-p and
renormalised. Which log-prob is reported is `InferenceConfig.logprobs`:

- "full" (`full_logprobs=True`): `log_softmax(logits / T)` over the whole vocabulary, before
  truncation — what SGLang 0.5.23's `Sampler.forward` returns (`srt/layers/sampler.py`:
  `log(softmax(logits / T))` taken before `_sample_from_probs` truncates) and what the learner
  recomputes (`learner.hf_model.forward_logprobs`);
- "truncated": the log-prob under the truncated, renormalised distribution actually sampled.

With no truncation the two agree. Greedy rows (temperature 0) report the untempered
log-prob of the argmax (SGLang's greedy path).
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


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row [B, 1]: from the row's own generator where it has one (a seeded
    request's stream: one draw per token, whatever else shares the batch), else from torch's."""
    if all(g is None for g in generators):
        return torch.rand(len(generators), 1, device=device)
    return torch.cat([torch.rand(1, generator=g, device=g.device if g is not None else device)
                      for g in generators]).to(device)[:, None]  # fmt: skip


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose CDF interval holds `u` [B, 1] scaled by the row's total mass:
    an exact categorical draw from `probs` [B, V] (unnormalised is fine). A token of zero mass
    is never returned: its interval is empty, and the scaled draw is kept below the total."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [B, V], by inverse transform on one uniform per row.

    `torch.multinomial` costs ~450 µs for a [16, 1024] batch on one CPU thread and ~50 µs per
    seeded row; this is one batched cumsum and searchsorted plus ~3 µs per seeded row's draw, the
    same distribution (tests/unit/inference/test_sampling.py checks the frequencies)."""
    return inverse_cdf(probs, uniforms(generators, probs.device))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    full_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 `logits` [B, V]; return (tokens [B], logprobs [B]): of the
    full tempered distribution with `full_logprobs`, else of the truncated one sampled from."""
    device = logits.device
    temps = [p.temperature for p in params]
    any_greedy = any(t <= 0 for t in temps)
    truncated = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
    # The common batch (one temperature, no truncation) takes ~4 tensor ops instead of ~15: a
    # scalar divides exactly as a tensor of equal values does, and without truncation the full and
    # the sampled log-probs are the same log_softmax.
    if not any_greedy and all(t == temps[0] for t in temps):
        scaled = logits if temps[0] == 1 else logits / temps[0]
        greedy = None
    else:
        temp_t = torch.tensor(temps, device=device, dtype=logits.dtype)
        greedy = temp_t <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temp_t), temp_t)[:, None]
    if truncated:
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
        full = scaled.log_softmax(dim=-1) if full_logprobs else None
        logp = _truncate(scaled, top_k, top_p, min_p).log_softmax(dim=-1)
        probs = logp.exp()
        if full is not None:
            logp = full
    else:
        logp = scaled.log_softmax(dim=-1)
        probs = logp.exp()
    tokens = draw(probs, generators)
    if any_greedy:
        raw = logits.log_softmax(dim=-1)
        arg = logits.argmax(dim=-1)
        tokens = torch.where(greedy, arg, tokens)
        logp = torch.where(greedy[:, None], raw, logp)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
