"""The vLLM command line agentrl starts: every flag RL relies on, and a missing venv named."""

from __future__ import annotations

import sys

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
