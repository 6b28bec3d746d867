"""`agentrl bench learner`: our train step vs a bare HF step, and packed vs padded batches.

    agentrl bench learner                      # tiny and small presets, ~1-2 min on 2 CPU cores
    agentrl bench learner --presets small --steps 5 --tokens 4096
    agentrl bench learner --presets tiny --steps 1 --tokens 128 --budget 256   # seconds: every path

1. vs_bare_hf — the same packed micro-batches of the same episodes through
   (a) our learner step: validation + advantages + packing + FSDP2 model + GRPO/TIS loss with
       its metrics + clipping + AdamW, exactly what the loop runs per batch, and
   (b) a bare Hugging Face step: the plain model, `model(input_ids, position_ids, labels)`,
       backward, AdamW.
   ratio = ours tokens/s ÷ bare tokens/s (target ≥ 0.9, i.e. ≤ 10% framework overhead).
2. packed_vs_padded — our step on a long-tailed (log-normal) length distribution, packed into
   token-budget micro-batches (in the learner's own rows: `learner.pack_row_tokens`, the bare
   step of 1 gets the same) vs padded rows under the same token budget; tokens/s counts real
   tokens.
3. critic_cost — a PPO step (`loss.advantage: gae`: the critic's forward for the old values,
   GAE, the actor's step, the critic's step) on the same episodes as the actor-only step of 1:
   ratio = PPO seconds per step ÷ actor-only seconds per step (about 2 would mean the critic
   costs as much as the actor).
4. megatron (`--megatron`, needs `agentrl[megatron]`) — the same actor-only step of 1 through
   `learner.backend: megatron` (TP 1, PP 1 on the one rank): tokens/s beside FSDP2's and bare HF's.

Runs alternate between the variants (rotating which goes first). Because these machines are
shared, ratios on CPU compare tokens per CPU-second of this process (median over steps); wall-clock
tokens/s and wall-clock ratios are in the metrics. On a GPU both steps run on the GPU and the
ratios use wall time (`metrics.ratio_basis`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from agentrl.bench.common import emit, print_table


def _groups(rng: np.random.Generator, total_tokens: int, long_tail: bool, vocab: int):
    from agentrl.types import Episode, Group

    groups, used = [], 0
    while used < total_tokens:
        eps = []
        for i in range(4):
            n = int(np.clip(rng.lognormal(4.0, 0.9), 16, 1024)) if long_tail else int(rng.integers(48, 80))
            prompt = max(2, n // 4)
            mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
            lp = np.where(mask == 1, -rng.uniform(0.1, 3.0, n), 0.0)
            eps.append(
                Episode(rng.integers(0, vocab, n), mask, lp, np.where(mask == 1, 0, -1), reward=float(i % 2))
            )
            used += n
        groups.append(Group(eps))
    return groups


def _clock(device) -> tuple[float, float]:
    """(wall, CPU) time of this process, after the device's queued work has finished."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


def _ours(learner, groups, padded: bool = False) -> tuple[tuple[float, float], int]:
    """The learner's own step (`learner.step`), as the loop runs it: with `loss.advantage: gae`,
    the critic's forward for the old values, GAE, the actor's step and the critic's step."""
    from agentrl.learner import step

    t0, c0 = _clock(learner.device)
    result = step.train(learner, step.prepare(learner, groups), padded=padded)
    t1, c1 = _clock(learner.device)
    return (t1 - t0, c1 - c0), result.tokens


def _bare(model, optimizer, plan, device) -> tuple[float, float]:
    """A plain HF step on the same micro-batches, on the same device as ours (copy included)."""
    t0, c0 = _clock(device)
    optimizer.zero_grad(set_to_none=True)
    for mb in plan:
        mb = mb.to(device)
        out = model(
            input_ids=mb.input_ids, position_ids=mb.position_ids, labels=mb.input_ids, use_cache=False
        )
        out.loss.backward()
    optimizer.step()
    t1, c1 = _clock(device)
    return t1 - t0, c1 - c0


NAMES = {"bare": "bare_hf"}  # a variant's name in the JSON, where it differs


def summarize(wall: dict[str, list[float]], cpu: dict[str, list[float]], on_gpu: bool) -> dict[str, float]:
    """Each variant's median tokens/s (`<name>_tok_s`) and tokens per CPU-second of this process
    (`<name>_tok_per_cpu_s`) over the measured steps, and the ratios between them.

    Ratios use tokens per CPU-second on CPU: other jobs on a shared machine stretch wall time but
    barely change the CPU work a step needs; on a GPU the step's work is the device's, not this
    process's CPU, so there they use wall time. Wall-clock ratios (`*_wall`) are reported alongside;
    on a dedicated machine the two agree. Both raw figures of every ratio are in the result."""
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    basis = med_wall if on_gpu else med_cpu
    out = {f"{NAMES.get(k, k)}_tok_s": v for k, v in med_wall.items()}
    out |= {f"{NAMES.get(k, k)}_tok_per_cpu_s": v for k, v in med_cpu.items()}
    if "megatron" in basis:
        out["megatron_vs_fsdp2"] = basis["megatron"] / basis["ours"]
    return out | {
        "vs_bare_hf": basis["ours"] / basis["bare"],
        "vs_bare_hf_wall": med_wall["ours"] / med_wall["bare"],
        "packed_vs_padded": basis["packed"] / basis["padded"],
        "packed_vs_padded_wall": med_wall["packed"] / med_wall["padded"],
        "critic_cost": basis["ours"] / basis["ppo"],  # PPO step time ÷ actor-only step time
        "critic_cost_wall": med_wall["ours"] / med_wall["ppo"],
    }


def bench_preset(
    preset: str, steps: int, tokens: int, budget: int, workdir: Path, megatron: bool = False
) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner import step
    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.loop import build_learner
    from agentrl.learner.packing import non_padding_fraction, padded_plan, plan_microbatches
    from agentrl.tiny_model import PRESETS, init_model

    model_dir = init_model(preset, workdir / preset)
    vocab = PRESETS[preset].vocab_size
    cfg = LearnerConfig(model_path=str(model_dir), micro_batch_tokens=budget, optim={"lr": 1e-5})
    learner = build_learner(cfg, workdir / f"run-{preset}")
    rows = learner.pack_rows  # the learner's own layout (step.pack), for the bare loop too
    ppo_cfg = LearnerConfig(model_path=str(model_dir), micro_batch_tokens=budget, optim={"lr": 1e-5},
                            loss={"advantage": "gae"}, critic={"optim": {"lr": 1e-5}})  # fmt: skip
    ppo = build_learner(ppo_cfg, workdir / f"run-ppo-{preset}")
    meg = None
    if megatron:
        meg_cfg = cfg.model_copy(update={"backend": "megatron"})
        meg = build_learner(meg_cfg, workdir / f"run-megatron-{preset}")
    bare = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).to(learner.device)  # the baseline runs where ours does (on a GPU machine: the GPU)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-5, foreach=True)
    rng = np.random.default_rng(0)
    uniform = [_groups(rng, tokens, False, vocab) for _ in range(steps + 1)]
    tailed = [_groups(rng, tokens, True, vocab) for _ in range(steps + 1)]

    wall: dict[str, list[float]] = {"ours": [], "bare": [], "packed": [], "padded": [], "ppo": []}
    if meg is not None:
        wall["megatron"] = []
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    counts: dict[str, int] = {}
    for i in range(steps + 1):  # step 0 warms up every path
        samples = step.prepare(learner, uniform[i]).mini_batches[0]
        bare_plan = plan_microbatches(samples, budget, row_tokens=rows)
        runs = {
            "ours": lambda i=i: _ours(learner, uniform[i]),
            "bare": lambda p=bare_plan: (
                _bare(bare, bare_opt, p, learner.device),
                sum(mb.real_tokens for mb in p),
            ),
            "packed": lambda i=i: _ours(learner, tailed[i]),
            "padded": lambda i=i: _ours(learner, tailed[i], padded=True),
            "ppo": lambda i=i: _ours(ppo, uniform[i]),
        }
        if meg is not None:
            runs["megatron"] = lambda i=i: _ours(meg, uniform[i])
        k = i % len(runs)
        order = list(runs)[k:] + list(runs)[:k]  # rotate so no variant always runs first
        for name in order:
            (wall_s, cpu_s), n = runs[name]()
            if i:
                wall[name].append(n / wall_s)
                cpu[name].append(n / cpu_s)
            counts[name] = n
        if (
            counts["ours"] != counts["bare"]
            or counts["packed"] != counts["padded"]
            or counts["ppo"] != counts["ours"]
            or counts.get("megatron", counts["ours"]) != counts["ours"]
        ):
            raise RuntimeError(f"the variants trained on different tokens: {counts}")  # not comparable
    tail_samples = step.prepare(learner, tailed[-1]).mini_batches[0]
    return summarize(wall, cpu, learner.device.type == "cuda") | {
        "non_padding_packed": non_padding_fraction(plan_microbatches(tail_samples, budget, row_tokens=rows)),
        "non_padding_padded": non_padding_fraction(padded_plan(tail_samples, budget)),
        "tokens_per_step_uniform": counts["ours"],
        "tokens_per_step_tailed": counts["packed"],
    }


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench learner", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up)")
    parser.add_argument("--tokens", type=int, default=768, help="episode tokens per step")
    parser.add_argument("--budget", type=int, default=384, help="micro-batch token budget")
    parser.add_argument("--megatron", action="store_true", help="add the Megatron-core backend's step (TP 1)")
    opts = parser.parse_args(args)

    import torch
    import torch.distributed as dist

    from agentrl.learner.fsdp import init_distributed

    torch.manual_seed(0)
    init_distributed()
    results = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-learner-") as tmp:
        for preset in opts.presets.split(","):
            results[preset] = bench_preset(
                preset, opts.steps, opts.tokens, opts.budget, Path(tmp), opts.megatron
            )
    rows = [
        [p, r["ours_tok_s"], r["bare_hf_tok_s"], r["vs_bare_hf"], r["vs_bare_hf_wall"], r["packed_vs_padded"],
         r["packed_vs_padded_wall"], f"{r['non_padding_packed']:.2f}/{r['non_padding_padded']:.2f}"]
        for p, r in results.items()
    ]  # fmt: skip
    print_table(
        f"learner step: {opts.tokens} tokens/step, {opts.budget}-token micro-batches, {torch.get_num_threads()} threads",
        [
            "model",
            "ours tok/s",
            "HF tok/s",
            "ours/HF",
            "(wall)",
            "packed/pad",
            "(wall)",
            "non-pad",
        ],
        rows,
    )
    print_table(
        "critic cost: a PPO step (critic forward, GAE, actor step, critic step) vs the actor-only step",
        ["model", "PPO tok/s", "actor-only tok/s", "PPO/actor time", "(wall)"],
        [
            [p, r["ppo_tok_s"], r["ours_tok_s"], r["critic_cost"], r["critic_cost_wall"]]
            for p, r in results.items()
        ],
    )
    if opts.megatron:
        print_table(
            "learner backends: the same actor-only step through FSDP2 and Megatron-core (TP 1), and bare HF",
            ["model", "FSDP2 tok/s", "Megatron tok/s", "HF tok/s", "Megatron/FSDP2"],
            [[p, r["ours_tok_s"], r["megatron_tok_s"], r["bare_hf_tok_s"], r["megatron_vs_fsdp2"]]
             for p, r in results.items()],
        )  # fmt: skip
    main_preset = "small" if "small" in results else next(iter(results))
    metrics = {f"{p}.{k}": v for p, r in results.items() for k, v in r.items()}
    metrics["ratios_from"] = main_preset
    metrics["ratio_basis"] = "wall" if torch.cuda.is_available() else "cpu"  # the learner's device
    keys = ("vs_bare_hf", "packed_vs_padded", "critic_cost")
    ratios = {k: results[main_preset][k] for k in keys}
    for p, r in results.items():
        if p != main_preset:
            ratios.update({f"{k}_{p}": r[k] for k in keys})
    emit("learner", metrics, ratios)
    dist.destroy_process_group()
    return 0
