"""Which deployment to buy: enumerate layouts of a cluster, keep those that fit in memory, rank them
by the simulator's samples/s, and write the chosen one as a runnable config.

Memory per device (bytes), the usual mixed-precision accounting:

- learner: bf16 weights and gradients plus fp32 master weights and Adam's two moments, 16 bytes a
  parameter, sharded over the learner's ranks (FSDP2 shards all of it; Megatron shards the model
  over tp × pp and, with its distributed optimizer, the fp32 state over data parallel too), plus
  activations of one micro-batch of `max_total_tokens` with full recompute (one hidden state per
  layer, bf16) and the logits of it in fp32;
- an inference server: bf16 weights over its tp ranks plus the KV cache of at least one group's
  episodes at full context;
- colocated: the learner's training state and, beside it, the generation layout's weight shard and
  its KV cache, on the same devices (what the HybridEngine keeps at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agentrl.plan.profile import Device, ModelShape, analytic
from agentrl.plan.sim import Deployment, SimResult, simulate
from agentrl.plan.workload import Workload

TRAIN_BYTES_PER_PARAM = 16
MEMORY_HEADROOM = 0.9  # what a framework can use of a device (allocator, CUDA context, NCCL buffers)


@dataclass(frozen=True)
class Hardware:
    device: Device
    gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.gpus < 2 and self.gpus != 1:
            raise ValueError(f"gpus must be at least 1, got {self.gpus}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs are not whole nodes of {self.gpus_per_node}")


@dataclass(frozen=True)
class Candidate:
    mode: str  # decoupled | colocated
    learner_gpus: int
    learner_tp: int
    learner_pp: int
    servers: int  # decoupled: inference servers; colocated: generation replicas
    server_tp: int
    rollers: int
    max_staleness: int

    @property
    def backend(self) -> str:
        return "fsdp2" if self.learner_tp == 1 and self.learner_pp == 1 else "megatron"

    @property
    def gpus(self) -> int:
        if self.mode == "colocated":
            return self.learner_gpus
        return self.learner_gpus + self.servers * self.server_tp

    def describe(self) -> str:
        learner = f"{self.learner_gpus} GPU {self.backend}"
        if self.backend == "megatron":
            learner += f" tp{self.learner_tp} pp{self.learner_pp}"
        if self.mode == "colocated":
            return f"colocated {learner}, generation tp{self.server_tp} × {self.servers}"
        return f"decoupled {learner} | {self.servers} server(s) × tp{self.server_tp} | {self.rollers} roller(s) | k={self.max_staleness}"


@dataclass
class Ranked:
    candidate: Candidate
    result: SimResult
    learner_memory: float
    server_memory: float
    push_s: float


def learner_memory(model: ModelShape, w: Workload, gpus: int, tp: int, pp: int) -> float:
    """Bytes per learner device (see the module docstring)."""
    dp = gpus // (tp * pp)
    if tp * pp == 1:
        state = TRAIN_BYTES_PER_PARAM * model.params / gpus
    else:
        # bf16 weights + grads over tp × pp; fp32 master and moments also over dp (distributed optimizer)
        state = 4 * model.params / (tp * pp) + 12 * model.params / (tp * pp * dp)
    activations = w.max_total_tokens * model.hidden * 2 * model.layers / (tp * pp)
    logits = w.max_total_tokens * 152_064 * 4 / tp  # a Qwen-sized vocabulary, fp32
    return state + activations + logits


def server_memory(model: ModelShape, w: Workload, tp: int) -> float:
    kv = model.kv_bytes_per_token * w.max_total_tokens * w.group_size
    return (2 * model.params + kv) / tp


def _divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8) if n % d == 0]


def candidates(model: ModelShape, hw: Hardware, w: Workload, ks: tuple[int, ...], roller_concurrency: int):
    """Every layout of `hw.gpus` the search considers, memory limits applied."""
    limit = hw.device.memory_bytes * MEMORY_HEADROOM
    per_node = min(hw.gpus, hw.gpus_per_node)

    def learner_layouts(gpus: int):
        for tp in _divisors(per_node):
            for pp in (1, 2, 4, 8):
                if gpus % (tp * pp) or pp > model.layers:
                    continue
                mem = learner_memory(model, w, gpus, tp, pp)
                if mem <= limit:
                    yield tp, pp, mem
                    return  # the smallest model-parallel layout that fits is the fastest here

    # colocated: every device trains and generates
    for tp, pp, mem in learner_layouts(hw.gpus):
        for gtp in _divisors(per_node):
            if mem + server_memory(model, w, gtp) <= limit:
                yield Candidate("colocated", hw.gpus, tp, pp, hw.gpus // gtp, gtp, 1, 0)
                break
    # decoupled: learner ranks, then servers on what is left
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n < hw.gpus})
    for lg in sizes:
        for tp, pp, _ in learner_layouts(lg):
            for stp in _divisors(per_node):
                if server_memory(model, w, stp) > limit:
                    continue
                servers = (hw.gpus - lg) // stp
                if servers < 1:
                    continue
                for k in ks:
                    episodes = (k + 1) * w.episodes_per_step
                    rollers = max(1, math.ceil(episodes / roller_concurrency))
                    yield Candidate("decoupled", lg, tp, pp, servers, stp, rollers, k)
                break  # one server width per learner size: the narrowest that fits


def profile_for(model: ModelShape, hw: Hardware, c: Candidate):
    cross_node = hw.gpus > hw.gpus_per_node
    return analytic(model, hw.device, c.server_tp, c.learner_gpus, cross_node)


def rank(
    model: ModelShape,
    hw: Hardware,
    w: Workload,
    ks: tuple[int, ...] = (0, 1, 2),
    roller_concurrency: int = 256,
    steps: int = 8,
    top: int = 5,
) -> list[Ranked]:
    """The best `top` candidates by predicted samples/s."""
    out = []
    for c in candidates(model, hw, w, ks, roller_concurrency):
        p = profile_for(model, hw, c)
        if c.mode == "colocated":
            p.push_base_s = p.push_bytes = 0.0
        workload = Workload(**{**w.__dict__, "max_staleness": c.max_staleness})
        d = Deployment(c.mode, c.servers, c.rollers, roller_concurrency)
        result = simulate(workload, p, d, steps=steps, warmup_steps=2)
        out.append(
            Ranked(
                c,
                result,
                learner_memory(model, w, c.learner_gpus, c.learner_tp, c.learner_pp),
                server_memory(model, w, c.server_tp),
                0.0 if c.mode == "colocated" else p.push_s(),
            )
        )
    out.sort(key=lambda r: -r.result.samples_per_s)
    return out[:top]


def to_config(c: Candidate, w: Workload, model_path: str) -> dict[str, Any]:
    """The chosen deployment as an `agentrl run` config for the Ray launcher."""
    learner: dict[str, Any] = {
        "model_path": model_path,
        "num_processes": c.learner_gpus,
        "groups_per_step": w.groups_per_step,
        "resources": {"GPU": 1},
    }
    if c.backend == "megatron":
        learner["backend"] = "megatron"
        learner["megatron"] = {"tp": c.learner_tp, "pp": c.learner_pp}
    roller = {"group_size": w.group_size, "max_total_tokens": w.max_total_tokens}
    config: dict[str, Any] = {
        "mode": c.mode,
        "max_staleness": c.max_staleness,
        "learner": learner,
        "roller": roller,
        "launcher": {"type": "ray"},
    }
    if c.mode == "colocated":
        config["colocated"] = {"num_processes": c.learner_gpus, "tg": c.server_tp, "t": c.learner_tp}
    else:
        roller["num_processes"] = c.rollers
        config["inference"] = {
            "type": "vllm",
            "num_servers": c.servers,
            "resources": {"GPU": c.server_tp},
            "vllm": {"tensor_parallel_size": c.server_tp},
        }
    return config
