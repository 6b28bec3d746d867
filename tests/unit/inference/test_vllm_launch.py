"""The vLLM command line agentrl starts: every flag RL relies on, and a missing venv named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentrl.config import InferenceConfig
from agentrl.inference import vllm_launch


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_carries_the_rl_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_API_KEY", "sekret")
    inference = InferenceConfig(
        type="vllm",
        context_length=2048,
        served_model_name="policy",
        vllm={"kv_cache_gb": 3, "extra_args": ["--seed", "5"]},
    )
    argv, env = vllm_launch.command("/m", "127.0.0.1", 8123, inference, python=sys.executable)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--generation-config") == "vllm"
    assert flag(argv, "--worker-extension-cls") == "agentrl.inference.vllm_worker.AgentRLWorkerExtension"
    assert (flag(argv, "--model"), flag(argv, "--port"), flag(argv, "--dtype")) == ("/m", "8123", "float32")
    assert (flag(argv, "--max-model-len"), flag(argv, "--served-model-name")) == ("2048", "policy")
    assert "--enforce-eager" in argv and argv[-2:] == ["--seed", "5"]
    assert "--enable-scale-out" in argv  # /inference/v1/generate: per-token weight versions
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_API_KEY"] == "sekret" and "sekret" not in " ".join(argv)
    assert env["PYTHONPATH"].split(":")[0] == str(vllm_launch._ROOT)


def test_kv_cache_is_sized_from_the_machine() -> None:
    assert 1 <= vllm_launch.kv_cache_gb() <= 16
    assert vllm_launch.kv_cache_gb(2.5) == 2.5


def test_missing_environment_says_make_vllm(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="make vllm"):
        vllm_launch.find_python(str(tmp_path / "nope/python"))


def test_lora_flags_come_from_inference_vllm_lora() -> None:
    """`inference.vllm.lora` starts vLLM with LoRA and its runtime load / unload routes; without it, neither."""
    plain, env = vllm_launch.command(
        "/m", "127.0.0.1", 1, InferenceConfig(type="vllm"), python=sys.executable
    )
    assert "--enable-lora" not in plain and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    lora = {"max_rank": 32, "max_loras": 3, "max_cpu_loras": 6}
    inference = InferenceConfig(type="vllm", vllm={"lora": lora})
    argv, env = vllm_launch.command("/m", "127.0.0.1", 1, inference, python=sys.executable)
    assert "--enable-lora" in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert (flag(argv, "--max-lora-rank"), flag(argv, "--max-loras"), flag(argv, "--max-cpu-loras")) == (
        "32",
        "3",
        "6",
    )
    with pytest.raises(ValueError, match="max_rank"):  # vLLM 0.32 takes only its MaxLoRARanks
        InferenceConfig(type="vllm", vllm={"lora": {"max_rank": 12}})


def test_sglang_lora_flags() -> None:
    from agentrl.inference.sglang_launch import sglang_command

    inference = InferenceConfig(
        type="sglang",
        sglang={"lora": {"max_rank": 16, "target_modules": ["q_proj", "v_proj"], "max_loaded_loras": 4}},
    )
    cmd = sglang_command("/m", "127.0.0.1", 1, inference, sys.executable)
    assert "--enable-lora" in cmd and flag(cmd, "--max-lora-rank") == "16"
    targets = cmd.index("--lora-target-modules")
    assert cmd[targets + 1 : targets + 3] == ["q_proj", "v_proj"]
    assert (flag(cmd, "--max-loras-per-batch"), flag(cmd, "--max-loaded-loras")) == ("8", "4")
    assert "--enable-lora" not in sglang_command(
        "/m", "127.0.0.1", 1, InferenceConfig(type="sglang"), sys.executable
    )


def vllm_environment(tmp_path: Path, cuda: bool, triton: bool) -> str:
    """A stand-in for vLLM's Python that answers the launcher's two probes as a vLLM environment
    would: `torch.cuda.is_available()` and vLLM's `HAS_TRITON` (`vllm/triton_utils/importing.py`)."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\ncase "$2" in *HAS_TRITON*) echo "HAS_TRITON {triton}";; *) echo "{cuda}";; esac\n'
    )
    python.chmod(0o755)
    return str(python)


def test_routed_experts_start_vllm_with_model_runner_v2_where_it_has_triton(tmp_path: Path) -> None:
    """What vLLM 0.32 requires to return routed experts (`_verify_aux_output_compatibility` in
    `vllm/config/vllm.py`): the flag, prefix caching, Model Runner V2; without the setting, none."""
    inference = InferenceConfig(type="vllm", routed_experts=True)
    gpu = vllm_environment(tmp_path, cuda=True, triton=True)
    argv, env = vllm_launch.command("/m", "127.0.0.1", 1, inference, python=gpu)
    assert "--enable-return-routed-experts" in argv and "--enable-prefix-caching" in argv
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and "--gpu-memory-utilization" in argv
    plain, env = vllm_launch.command("/m", "127.0.0.1", 1, InferenceConfig(type="vllm"), python=gpu)
    assert "--enable-return-routed-experts" not in plain and "VLLM_USE_V2_MODEL_RUNNER" not in env


def test_routed_experts_are_refused_where_vllm_has_no_triton(tmp_path: Path) -> None:
    inference = InferenceConfig(type="vllm", routed_experts=True)
    cpu = vllm_environment(tmp_path, cuda=False, triton=False)
    with pytest.raises(RuntimeError, match=r"routed experts only from its Model Runner V2.*requires Triton"):
        vllm_launch.command("/m", "127.0.0.1", 1, inference, python=cpu)
    # a Python without vLLM: the launcher says it could not ask, rather than guess
    with pytest.raises(RuntimeError, match=r"could not ask vLLM in .* whether it has Triton"):
        vllm_launch.command("/m", "127.0.0.1", 1, inference, python=sys.executable)
