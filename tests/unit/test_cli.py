"""The command line as users run it: a real child process per invocation."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_agentrl

COMMANDS = [
    "colocated",
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
    "env",
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
    result = run_agentrl("doctor", f"--learner.model_path={tiny_model}", "--inference.vllm.python=/nonexistent/python",
                         env={"COLUMNS": "240"})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode round-trip exact" in result.stdout
    # vLLM lives in its own environment: the hint is the Makefile's, not a pip extra
    assert re.search(r"vllm +│ absent \(make vllm: vLLM in its own \.venv-vllm\)", result.stdout), (
        result.stdout
    )
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


def test_an_unknown_env_in_a_config_is_one_line_and_the_traceback_comes_with_debug(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"learner:\n  model_path: {tiny_model}\nenv:\n  name: toy_lookupp\n")
    result = run_agentrl("run", "--config", str(config), f"--run_dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "agentrl: env.name: unknown env 'toy_lookupp' (did you mean toy_lookup?); registered: toy_lookup, "
        "toy_calculator, toy_calculator_slow, toy_lookup_slow, search_r1, search_r1_tools, swe, agent (other "
        "packages add names through the entry-point group 'agentrl.envs'), or a dotted path like my_pkg.envs:MyEnv"
    ]
    assert not (tmp_path / "logs").exists()  # nothing was started
    debug = run_agentrl("--debug", "run", "--config", str(config), f"--run_dir={tmp_path}")
    assert (
        debug.returncode != 0 and "Traceback" in debug.stderr and "unknown env 'toy_lookupp'" in debug.stderr
    )
    missing = run_agentrl("run", "--config", str(config), "--env.name=examples.word_tools:WordToolz")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "has no class 'WordToolz'; did you mean examples.word_tools:WordTools?" in missing.stderr
    (tmp_path / "broken_env.py").write_text(
        "from agentrl.envs import Env\n\n\nclass Broken(Env):\n    def __init__(self):\n"
        "        raise RuntimeError('broken on purpose')\n"
    )
    broken = run_agentrl("run", "--config", str(config), "--env.name=broken_env:Broken",
                         env={"PYTHONPATH": f"{tmp_path}:{REPO}"})  # fmt: skip
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "agentrl: env.name: broken_env:Broken: RuntimeError: broken on purpose" in broken.stderr


def test_a_missing_model_path_names_the_directory_it_looked_in_and_the_recipes_preset(tmp_path: Path) -> None:
    # run from another directory, as a user may: the recipe's path is relative to the working directory
    result = subprocess.run(
        [sys.executable, "-m", "agentrl", "run", "--config", str(REPO / "recipes/quickstart.yaml")],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        f"learner.model_path: runs/models/mini is not a checkpoint directory (relative to the current "
        f"directory {tmp_path}); make one: agentrl init-model mini runs/models/mini"
    ) in result.stderr


@pytest.mark.skipif(
    not shutil.which("prlimit"), reason="util-linux prlimit is needed to probe sandbox isolation"
)
def test_sandbox_exec_without_bubblewrap_names_min_isolation_and_what_it_gives_up(tmp_path: Path) -> None:
    # a PATH holding the tools the isolation probe looks for, except bwrap: a machine without bubblewrap
    for tool in ("prlimit", "setpriv", "unshare", "chroot", "sh"):
        if shutil.which(tool):
            (tmp_path / tool).symlink_to(shutil.which(tool))
    result = run_agentrl("sandbox", "exec", "--", "python3", "-c", "print(1)", env={"PATH": str(tmp_path)})
    assert result.returncode == 3
    assert "below sandbox.min_isolation='bwrap'" in result.stderr
    assert (
        "To run trusted code anyway: --min-isolation namespaces (gives up bubblewrap's seccomp filter"
        in result.stderr
    )
    assert "--min-isolation rlimits (gives up all isolation" in result.stderr


def test_the_readme_shows_the_real_moved_key_message(tmp_path: Path) -> None:
    config = tmp_path / "old.yaml"
    config.write_text("learner:\n  lr: 1.0e-3\n")
    result = run_agentrl("config", "show", "--config", str(config))
    said = result.stderr.strip().splitlines()[-1].strip()
    assert result.returncode == 2 and said == "learner: moved keys: learner.lr is now learner.optim.lr"
    assert f"(`{said}`)" in (REPO / "README.md").read_text()
