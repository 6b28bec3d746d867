"""The command line as users run it: a real child process per invocation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_agentrl

COMMANDS = [
    "learner",
    "roller",
    "serve",
    "queue",
    "run",
    "warmstart",
    "eval",
    "init-model",
    "bench",
    "doctor",
    "sandbox",
    "sandbox-server",
    "retriever",
]


def test_help_lists_every_command() -> None:
    result = run_agentrl("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout


def test_help_imports_no_heavy_library() -> None:
    code = (
        "import sys; from agentrl.cli import app\n"
        "from typer.main import get_command; get_command(app)\n"
        "heavy = [m for m in ('torch', 'transformers', 'zmq', 'numpy', 'aiohttp', 'ray') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""


def test_bad_override_fails_before_anything_starts() -> None:
    result = run_agentrl("learner", "--config", "recipes/quickstart.yaml", "--learner.optim.lrr", "1e-6")
    assert result.returncode == 2
    assert "learner.optim.lrr: unknown key (did you mean 'lr'?)" in result.stderr


def test_run_refuses_a_missing_model_before_starting_anything(tmp_path: Path) -> None:
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path}", "--learner.model_path=/nope"
    )
    assert result.returncode == 2
    assert "learner.model_path: /nope is not a checkpoint directory" in result.stderr
    assert not (tmp_path / "logs").exists()  # no process was started


def test_unknown_benchmark_names_the_choices() -> None:
    result = run_agentrl("bench", "nope")
    assert result.returncode == 2
    assert "serve, queue, roller, learner, sync, async" in result.stderr


def test_init_model_then_offline_load_in_a_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "m"
    result = run_agentrl("init-model", "tiny", str(out))
    assert result.returncode == 0, result.stderr
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "print(m.config.model_type, t.apply_chat_template([{'role': 'user', 'content': 'x'}], tokenize=False))"
    )
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    loaded = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("qwen2 <|im_start|>system")


def test_init_model_rejects_unknown_preset(tmp_path: Path) -> None:
    result = run_agentrl("init-model", "huge", str(tmp_path))
    assert result.returncode == 2 and "tiny, mini, small" in result.stderr


def test_doctor_reports_a_usable_model(tiny_model: Path) -> None:
    result = run_agentrl("doctor", f"--learner.model_path={tiny_model}", env={"COLUMNS": "240"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode round-trip exact" in result.stdout
    missing = run_agentrl("doctor", "--learner.model_path=/nonexistent/model", env={"COLUMNS": "240"})
    assert missing.returncode == 1 and "agentrl init-model tiny" in missing.stdout


def test_help_names_the_real_model_presets_and_the_config_sections() -> None:
    from agentrl.tiny_model import PRESETS

    init = run_agentrl("init-model", "--help")
    assert all(name in init.stdout for name in PRESETS)
    for command in ("run", "roller", "learner", "queue"):
        shown = run_agentrl(command, "--help").stdout
        assert "weight_sync" in shown and "agentrl config show" in shown, command


def test_config_show_prints_fields_and_the_values_a_config_sets() -> None:
    result = run_agentrl("config", "show", "--config", "recipes/quickstart.yaml", "env")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.startswith("env:")
        and 'env.name: str = "toy_calculator"  (set: "toy_lookup")' in result.stdout
    )


def test_queue_ignores_sections_it_does_not_use_and_missing_models_name_the_field(tmp_path: Path) -> None:
    # agentrl queue reads queue and learner only: an sglang inference section without servers is fine
    # (it gets as far as the queue's own check of its secret)
    queue = run_agentrl(
        "queue", "--inference.type", "sglang", "--bind", "tcp://127.0.0.1:1", env={"AGENTRL_QUEUE_SECRET": ""}
    )
    assert "inference.servers" not in queue.stderr
    missing = tmp_path / "no-model"
    learner = run_agentrl("learner", "--learner.model_path", str(missing))
    assert learner.returncode == 2
    assert f"learner.model_path: {missing} is not a checkpoint directory" in learner.stderr
    assert "Traceback" not in learner.stderr
