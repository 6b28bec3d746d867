"""`agentrl serve --backend sglang`: a real SGLang server started with the flags RL needs.

SGLang pins its own torch and CUDA kernels (0.5.23: torch 2.14.1), so it lives in its own
environment (`make sglang` creates `.venv-sglang` on a GPU machine; it cannot run on a
CPU-only one). This module only builds the command line and supervises the process:

    agentrl serve --backend sglang --model DIR --port 30000 [--inference.dtype bfloat16]

1. find the interpreter (`$AGENTRL_SGLANG_PYTHON`, else `.venv-sglang/bin/python`, else this
   one) and check, in bounded time, that it can import `sglang`;
2. start `python -m sglang.launch_server` (`sglang_command`) in its own session, with
   `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0` so `/health` is a flag check instead of a
   one-token generation (`health_generate` in `srt/entrypoints/http_server.py`), cheap enough
   for the router's probes;
3. wait until `/health` answers (failing early if the process exits), then wait on it;
4. on SIGINT/SIGTERM stop it by its PID (its process group): SIGTERM, then SIGKILL.

Flags (all fields of SGLang 0.5.23's `ServerArgs`, `srt/arg_groups/fields/`): `--model-path`,
`--host`, `--port`, `--dtype`, `--weight-version 0` (versions are integers here; SGLang
starts at "default" otherwise), `--context-length`, `--served-model-name`, `--api-key` from
`inference.api_key_env`; with `inference.sglang.lora`, `--enable-lora`, `--max-lora-rank`,
`--lora-target-modules`, `--max-loras-per-batch` and `--max-loaded-loras` (`fields/lora.py`;
adapters are then loaded at run time: `agentrl/inference/lora.py`). Behaviour log-probs are SGLang's only kind, the full tempered
distribution (`inference.logprobs: full`; "truncated" is refused by the config).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.inference.config import InferenceConfig

logger = get_logger(__name__)

VENV_PYTHON = Path(".venv-sglang/bin/python")


def sglang_python() -> str:
    """The interpreter whose environment has SGLang."""
    if os.environ.get("AGENTRL_SGLANG_PYTHON"):
        return os.environ["AGENTRL_SGLANG_PYTHON"]
    return str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def sglang_command(model_path: str, host: str, port: int, config: InferenceConfig, python: str) -> list[str]:
    """`python -m sglang.launch_server ...` for `config` (an `InferenceConfig`)."""
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    cmd += ["--dtype", config.dtype, "--weight-version", "0"]
    if config.context_length:
        cmd += ["--context-length", str(config.context_length)]
    if config.served_model_name:
        cmd += ["--served-model-name", config.served_model_name]
    lora = config.sglang.lora
    if lora is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora.max_rank)]
        cmd += ["--lora-target-modules", *lora.target_modules]
        cmd += ["--max-loras-per-batch", str(lora.max_loras_per_batch)]
        if lora.max_loaded_loras is not None:
            cmd += ["--max-loaded-loras", str(lora.max_loaded_loras)]
    if config.routed_experts:
        cmd += ["--enable-return-routed-experts"]
    api_key = os.environ.get(config.api_key_env)
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def check_importable(python: str, timeout_s: float = 60) -> None:
    """Raise RuntimeError saying how to get SGLang when `python` cannot find it."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang.launch_server') is None)"
    try:
        found = subprocess.run([python, "-c", probe], timeout=timeout_s, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"--backend sglang: cannot run {python}: {exc}") from None
    if not found:
        raise RuntimeError(
            f"--backend sglang: {python} cannot import sglang. SGLang 0.5.23 needs a CUDA GPU and its own "
            "environment: run `make sglang` on a GPU node (creates .venv-sglang), or set AGENTRL_SGLANG_PYTHON "
            "to an interpreter that has sglang; it cannot run on a CPU-only machine"
        )


def run_sglang(model_path: str, host: str, port: int, config: InferenceConfig, timeout_s: float = 900) -> int:
    """Start SGLang, wait for its health, serve until it exits or we are signalled; its exit code."""
    from agentrl.net import wait_healthy

    python = sglang_python()
    check_importable(python)
    cmd = sglang_command(model_path, host, port, config, python)
    env = {**os.environ, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    logger.info(
        "starting SGLang: %s", " ".join(a if a != os.environ.get(config.api_key_env) else "***" for a in cmd)
    )
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        wait_healthy([f"http://{host}:{port}"], [proc], timeout_s=timeout_s)
        logger.info("SGLang is healthy on http://%s:%d (pid %d)", host, port, proc.pid)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop_by_pid(proc)


def stop_by_pid(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("SGLang (pid %d) did not stop within %.0fs: killing it", proc.pid, grace_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
