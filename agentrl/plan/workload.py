"""What a run asks of the pipeline, as distributions: the planner's input besides the hardware.

A `Workload` is read from YAML (`agentrl plan --workload FILE`) or built from a run's config
(`from_config`). Lengths are in tokens, latencies in seconds. Each quantity is a `Dist`, written in
YAML as a number (a constant) or a mapping with `kind`:

    response_tokens: {kind: lognormal, median: 200, p99: 1500}
    tool_latency_s: {kind: lognormal, median: 0.1, p99: 1.0}
    turns: {kind: uniform, low: 1, high: 4}
    prompt_tokens: 300
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class Dist:
    """A non-negative quantity: `const` (value), `uniform` (low..high), `lognormal` (median, p99),
    `pareto` (median, alpha, capped at high: the toy envs' long-tailed tool latency), or `choice`
    (values, drawn uniformly). Integer quantities are rounded by the caller."""

    kind: str = "const"
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    median: float = 0.0
    p99: float = 0.0
    values: tuple[float, ...] = ()
    alpha: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in ("const", "uniform", "lognormal", "pareto", "choice"):
            raise ValueError(
                f"unknown distribution kind {self.kind!r} (const, uniform, lognormal, pareto, choice)"
            )
        if self.kind == "pareto" and not (self.median > 0 and self.alpha > 1 and self.high >= self.median):
            raise ValueError(f"pareto needs median > 0, alpha > 1, high >= median; got {self}")
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError(f"uniform needs 0 <= low <= high, got low={self.low} high={self.high}")
        if self.kind == "lognormal" and not 0 < self.median <= self.p99:
            raise ValueError(f"lognormal needs 0 < median <= p99, got median={self.median} p99={self.p99}")
        if self.kind == "choice" and not self.values:
            raise ValueError("choice needs a non-empty `values` list")

    @classmethod
    def parse(cls, spec: Any) -> Dist:
        if isinstance(spec, Dist):
            return spec
        if isinstance(spec, (int, float)):
            return cls("const", value=float(spec))
        if isinstance(spec, dict):
            spec = dict(spec)
            if "values" in spec:
                spec["values"] = tuple(float(v) for v in spec["values"])
            return cls(**spec)
        raise ValueError(f"a distribution is a number or a mapping with `kind`, got {spec!r}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99 if self.kind == "lognormal" else 0.0

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.value
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "pareto":  # as envs/toy.py's ParetoLatency: scaled so the median is `median`
            return min(self.high, self.median * rng.paretovariate(self.alpha) / 2 ** (1 / self.alpha))
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def mean(self) -> float:
        if self.kind == "const":
            return self.value
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "choice":
            return sum(self.values) / len(self.values)
        if self.kind == "pareto":  # E[min(c, s·X)] for X ~ Pareto(alpha, 1), s = median / 2^(1/alpha)
            scale, a = self.median / 2 ** (1 / self.alpha), self.alpha
            cap = self.high / scale
            return scale * (a / (a - 1) - cap ** (1 - a) / (a - 1)) if cap > 1 else self.high
        return self.median * math.exp(self.sigma**2 / 2)


@dataclass
class Workload:
    """One training step's work and the shape of its episodes.

    An episode is `turns` model turns; turn i generates `response_tokens` tokens after a prefill
    of what the context gained since the last turn (the prompt first, then `tool_tokens` of each
    tool result); between turns the episode waits `tool_latency_s` for its tool."""

    prompt_tokens: Dist = field(default_factory=lambda: Dist(value=128))
    response_tokens: Dist = field(default_factory=lambda: Dist(value=64))
    turns: Dist = field(default_factory=lambda: Dist(value=1))
    tool_tokens: Dist = field(default_factory=lambda: Dist(value=32))
    tool_latency_s: Dist = field(default_factory=lambda: Dist(value=0.0))
    group_size: int = 8
    groups_per_step: int = 8
    max_staleness: int = 0
    max_total_tokens: int = 4096

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown workload field(s) {unknown}; allowed: {sorted(names)}")
        parsed = {
            k: Dist.parse(v) if isinstance(getattr(cls(), k), Dist) else int(v) for k, v in data.items()
        }
        return cls(**parsed)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for k, v in asdict(self).items():
            if isinstance(v, dict):
                kind = v["kind"]
                keep = {"const": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "p99"),
                        "pareto": ("median", "alpha", "high")}  # fmt: skip
                keys = keep.get(kind, ("values",))
                out[k] = v["value"] if kind == "const" else {"kind": kind, **{x: v[x] for x in keys}}
            else:
                out[k] = v
        return out

    @property
    def episodes_per_step(self) -> int:
        return self.group_size * self.groups_per_step

    def mean_episode_tokens(self) -> float:
        """Mean tokens of a trained sequence (prompt, responses, tool results), capped by the budget."""
        turns = max(1.0, self.turns.mean())
        total = self.prompt_tokens.mean() + turns * self.response_tokens.mean()
        total += (turns - 1) * self.tool_tokens.mean()
        return min(total, float(self.max_total_tokens))


def from_config(config: Any, **overrides: Any) -> Workload:
    """A workload with the run config's shape (group size, groups per step, k, budgets); lengths and
    tool latencies are not in a config, so they come from `overrides` or the defaults."""
    roller = config.roller
    base = {
        "group_size": roller.group_size,
        "groups_per_step": config.learner.groups_per_step,
        "max_staleness": config.max_staleness,
        "max_total_tokens": roller.max_total_tokens,
        "response_tokens": roller.max_new_tokens,
        "turns": roller.max_turns,
    }
    base.update(overrides)
    return Workload.from_dict(base)
