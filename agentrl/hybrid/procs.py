"""Rank set-up shared by `agentrl bench reshard` and the hybrid tests: a preset's Qwen2 config,
a gloo process group on loopback, and `world` spawned ranks waited for with a deadline (a rank
that fails leaves the others blocked in a collective, so the first failure stops the wait)."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

from agentrl.net import free_port


def preset_config(preset: str, **overrides: Any):
    """The `Qwen2Config` of an agentrl/tiny_model.py preset (tied embeddings), with `overrides`."""
    from agentrl.tiny_model import PRESETS, qwen2_config

    return qwen2_config(PRESETS[preset], **overrides)


def init_gloo(rank: int, world: int, port: int) -> None:
    """This rank's default process group: gloo over 127.0.0.1:`port`."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_ranks(target: Callable[..., None], world: int, args: tuple, timeout_s: float, what: str) -> None:
    """Spawn `target(rank, world, port, *args)` on `world` ranks and wait for all of them; raise
    RuntimeError naming the exit codes if one fails or `timeout_s` passes (the rest are killed)."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"{what} on {world} ranks: exit codes {codes} (limit {timeout_s:.0f} s)")
