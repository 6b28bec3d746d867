"""`agentrl plan calibrate`: measure this machine's `CostProfile` for a model, one component at a time.

    agentrl plan calibrate --model runs/models/mini --out profile.json

- **server**: a real `agentrl serve` of the model, with the one intra-op thread `agentrl run` gives
  it; b requests at once (b = 1, 4, 16) of prompt length L (16 and 96), each generating 1 and then
  `--new-tokens` tokens (`ignore_eos`); a step's time is the difference over the extra tokens, the
  prefill the one-token time. Least squares fit `decode_s = base + per_seq × b + per_ctx × Σ context`
  and `prefill_s = base + per_token × tokens`.
- **push**: `BroadcastEngine.push` of the model into that server, as the learner pushes (median of 3
  after a warm-up).
- **learner**: the learner's own step (`learner.step`, FSDP2 on one rank, one thread) on synthetic
  groups of two sizes; `train_s = base + tokens / tokens_per_s` through both points.
- **cores**: this machine's CPU count when no GPU is used (servers and learner then share it).
- **colocated** (`--colocated CONFIG`, a `mode: colocated` recipe): a short real `agentrl run` of
  that config on the model (`--colocated-steps` steps, no warm start), read from its
  `learner.jsonl` after its first step (which warms the engines up): `reshard_s`, the median of
  each step's logged `time/reshard_s` + `time/release_s` (training shards to generation buffers,
  and the buffers and KV cache released); `colocated_tokens_per_s`, the median of the logged
  `tokens_per_s` of the colocated learner (all its ranks, FSDP2 over them, at that run's step
  size); `colocated_loop_s`, the median of each step's wall time (between consecutive records)
  less its logged generation, reshard, release and training seconds: the loop's own work
  (sharing groups across ranks, advantages and packing, logging). Generation itself is not read
  from that run: the simulator predicts it from the server's step costs above.

Each measurement is written into the profile's `source` beside the fitted numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.plan.profile import CostProfile


async def _timed(client: Any, b: int, prompt_len: int, new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    prompts = [[(7 * i + 13 * k) % 400 + 20 for k in range(prompt_len)] for i in range(b)]
    t0 = time.perf_counter()
    await asyncio.gather(*(client.generate(p, params) for p in prompts))
    return time.perf_counter() - t0


async def _server_points(url: str, new_tokens: int, repeats: int) -> tuple[list, list]:
    from agentrl.inference.sglang import SGLangClient

    decode, prefill = [], []
    async with SGLangClient(url, timeout_s=600) as client:
        await _timed(client, 4, 16, 4)  # warm-up
        for prompt_len in (16, 96):
            for b in (1, 4, 16):
                one = statistics.median([await _timed(client, b, prompt_len, 1) for _ in range(repeats)])
                many = statistics.median(
                    [await _timed(client, b, prompt_len, new_tokens) for _ in range(repeats)]
                )
                step = max(0.0, (many - one) / (new_tokens - 1))
                decode.append((b, b * (prompt_len + new_tokens / 2), step))
                prefill.append((b * prompt_len, one))
    return decode, prefill


def _fit(rows: list[tuple], n_features: int) -> list[float]:
    """Non-negative least squares by clipping: coefficients of [1, x1, ...] for the last column."""
    a = np.array([[1.0, *r[:n_features]] for r in rows])
    y = np.array([r[n_features] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [max(0.0, float(c)) for c in coef]


def _push_seconds(model_dir: str, url: str, repeats: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.inference.config import InferenceConfig
    from agentrl.weight_sync.config import BroadcastSyncConfig
    from agentrl.weight_sync.registry import create

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nbytes = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    engine = create(BroadcastSyncConfig(timeout_s=300), InferenceConfig(servers=[url]))
    engine.init()
    try:
        times = []
        for version in range(1, repeats + 2):
            stats = engine.push(model.named_parameters, version)
            if stats.servers_updated != 1:
                raise RuntimeError(f"calibration push {version} did not commit: {stats.outcomes}")
            if version > 1:
                times.append(stats.seconds)
    finally:
        engine.close()
    return statistics.median(times), nbytes


def _learner_points(model_dir: str, workdir: Path, steps: int) -> list[tuple[float, float]]:
    from transformers import AutoConfig

    from agentrl.bench.learner import _groups, _ours
    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.loop import build_learner

    cfg = LearnerConfig(model_path=model_dir, micro_batch_tokens=4096, optim={"lr": 1e-5})
    learner = build_learner(cfg, workdir / "learner")
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = np.random.default_rng(0)
    points = []
    for total in (1024, 4096):
        _ours(learner, _groups(rng, total, False, vocab))  # warm-up at this size
        walls, tokens = [], 0
        for _ in range(steps):
            (wall, _cpu), tokens = _ours(learner, _groups(rng, total, False, vocab))
            walls.append(wall)
        points.append((float(tokens), statistics.median(walls)))
    return points


def calibrate_colocated(
    model_dir: str, workdir: Path, config: Path, steps: int = 4, overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The colocated costs (module docstring, **colocated**) from a short real run of `config`;
    `overrides` are further `agentrl run` options (e.g. the groups per step the prediction is for).
    Returns the profile's fields and their `source` lines."""
    from agentrl.bench.common import stop_child
    from agentrl.log import read_metrics

    if steps < 3:
        raise ValueError("the colocated calibration needs at least 3 steps (the first is a warm-up)")
    if not Path(config).is_file():
        raise FileNotFoundError(f"colocated config {config} not found")
    run_dir = workdir / "colocated"
    args = [sys.executable, "-m", "agentrl", "run", "--config", str(config), f"--run_dir={run_dir}",
            f"--learner.model_path={model_dir}", f"--learner.max_steps={steps}", "--learner.warmstart.steps=0",
            *overrides]  # fmt: skip
    # its own session, stopped with time to stop its ranks if we are interrupted (as the benches do)
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate()
    except BaseException:
        stop_child(proc, 120)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"colocated calibration run failed:\n{out[-3000:]}{err[-3000:]}")
    records = read_metrics(run_dir / "learner.jsonl")
    if len(records) < 3 or "time/reshard_s" not in records[-1]:
        raise RuntimeError(f"{run_dir / 'learner.jsonl'}: {len(records)} colocated step records, 3 needed")
    timed = list(pairwise(records[1:]))  # (previous, this): the step's wall time
    phases = ("time/generation_s", "time/reshard_s", "time/release_s", "time/train_s")
    reshard = statistics.median(r["time/reshard_s"] + r["time/release_s"] for r in records[1:])
    rate = statistics.median(r["tokens_per_s"] for r in records[1:])
    loop = statistics.median(
        max(0.0, (r["time"] - prev["time"]) - sum(r[k] for k in phases)) for prev, r in timed
    )
    return {
        "reshard_s": reshard,
        "colocated_tokens_per_s": rate,
        "colocated_loop_s": loop,
        "source": {
            "colocated": f"{config} {' '.join(overrides)}, {steps} steps; after the first: reshard + "
            f"release {reshard:.3f} s, learner {rate:.0f} tokens/s, loop {loop:.3f} s (medians)",
        },
    }


def calibrate(
    model_dir: str,
    workdir: Path,
    new_tokens: int = 16,
    repeats: int = 3,
    colocated: dict[str, Any] | None = None,
) -> CostProfile:
    """The profile's components, measured; with `colocated` (the keyword arguments of
    `calibrate_colocated` but `model_dir` and `workdir`) the colocated costs too."""
    from agentrl.net import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # as `agentrl run` starts it
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve", "--model", model_dir, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        wait_healthy([url], [server])
        decode, prefill = asyncio.run(_server_points(url, new_tokens, repeats))
        push_s, push_bytes = _push_seconds(model_dir, url, repeats)
    finally:
        server.terminate()
        server.wait(30)
    import torch

    torch.set_num_threads(1)
    learner = _learner_points(model_dir, workdir, repeats)
    (t1, s1), (t2, s2) = learner
    per_token = max(1e-12, (s2 - s1) / (t2 - t1))
    d_base, d_seq, d_ctx = _fit(decode, 2)
    p_base, p_tok = _fit(prefill, 1)
    gpu = torch.cuda.is_available()
    colo = calibrate_colocated(model_dir, workdir, **colocated) if colocated else {"source": {}}
    profile = CostProfile(
        decode_base_s=d_base,
        decode_per_seq_s=d_seq,
        decode_per_ctx_token_s=d_ctx,
        prefill_base_s=p_base,
        prefill_per_token_s=p_tok,
        train_base_s=max(0.0, s1 - t1 * per_token),
        learner_tokens_per_s=1.0 / per_token,
        push_base_s=0.0,
        push_bytes=push_bytes,
        push_bytes_per_s=push_bytes / push_s,
        cores=0 if gpu else (os.cpu_count() or 1),
        source={
            "kind": "measured",
            "model": model_dir,
            "host": os.uname().nodename,
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "decode_points": str([(b, round(c), round(t, 5)) for b, c, t in decode]),
            "prefill_points": str([(n, round(t, 5)) for n, t in prefill]),
            "learner_points": str([(round(n), round(t, 4)) for n, t in learner]),
            "push": f"{push_bytes / 1e6:.1f} MB in {push_s:.3f} s (median of {repeats})",
            **colo.pop("source"),
        },
    )
    for key, value in colo.items():
        setattr(profile, key, value)
    return profile


def main(args: list[str]) -> int:
    p = argparse.ArgumentParser(prog="agentrl plan calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local HF checkpoint (e.g. from `agentrl init-model`)")
    p.add_argument("--out", type=Path, default=Path("profile.json"))
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--colocated", type=Path, help="a `mode: colocated` config: also measure its reshard, "
                   "learner and loop costs in a short real run of it")  # fmt: skip
    p.add_argument("--colocated-steps", type=int, default=4)
    opts = p.parse_args(args)
    if opts.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (a step is the difference over the extra tokens)")
    if opts.colocated_steps < 3:
        p.error("--colocated-steps must be at least 3 (the first is a warm-up, then two step intervals)")
    with tempfile.TemporaryDirectory(prefix="agentrl-calibrate-") as tmp:
        colocated = {"config": opts.colocated, "steps": opts.colocated_steps} if opts.colocated else None
        profile = calibrate(opts.model, Path(tmp), opts.new_tokens, opts.repeats, colocated)
    profile.save(opts.out)
    for key, value in profile.source.items():
        print(f"{key}: {value}")
    print(f"wrote {opts.out}")
    return 0
