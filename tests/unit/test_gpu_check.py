"""scripts/gpu_check.py's dry run, as CI runs it: the plan, every step's command, the report, and the
steps that can run on CPU at tiny size (the push into the embedded server over gloo, the engine's
release / rebuild, the MoE routing and router replay comparison) run for real; the GPU-only steps
are reported skipped, with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_dry_run_runs_the_cpu_steps_and_reports_every_step(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    done = _check("--dry-run", "--report", str(report_path), "--workdir", str(tmp_path / "wd"),
                  "--python", sys.executable)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["environment", "install", "push_embedded", "offload", "push_vllm", "moe_vllm",
                           "colocated_run", "bench_sync", "bench_peer"]  # fmt: skip
    assert report["summary"] == {"pass": 4, "fail": 0, "skipped": 5}
    for step in steps.values():
        assert step["command"], step  # every step's command is built, run or not
        if step["status"] == "skipped":
            assert step["reason"].startswith("dry run: "), step
    push = steps["push_embedded"]["details"]
    assert push["backend"] == "gloo" and push["servers_updated"] == 1 and push["version_read_back"] == 1
    assert push["max_abs_logprob_diff_after_push"] < 1e-3 < push["max_abs_logprob_diff_before_push"]
    offload = steps["offload"]["details"]
    assert offload["param_bytes_released"] > 0 and offload["max_abs_logprob_diff"] <= 1e-6
    moe = steps["moe_vllm"]["details"]  # the routing / replay comparison, against the embedded server
    assert moe["served_by"].startswith("agentrl embedded") and moe["repeated_prompt_rows_equal"]
    assert moe["token_layers_equal_to_transformers"] == moe["token_layers_compared"] > 0
    assert moe["learner_token_layers_routed_elsewhere"] > 0
    assert moe["mean_abs_logprob_diff_replay"] < moe["mean_abs_logprob_diff_no_replay"]
    assert steps["install"]["command"] == ["make", "setup", "vllm"]
    assert "--preset" in steps["bench_sync"]["command"] and "peer" in steps["bench_peer"]["command"]


def test_arguments_budget_and_a_machine_without_a_gpu(tmp_path: Path) -> None:
    bad = _check("--dry-run", "--steps", "environment,warp_drive", timeout=60)
    assert bad.returncode == 2 and "unknown ['warp_drive']" in bad.stderr
    assert _check("--budget-s", "0", timeout=60).returncode == 2
    report_path = tmp_path / "r.json"
    # a budget too small for any step: skipped, saying so, and the report is still written
    done = _check("--dry-run", "--steps", "environment", "--budget-s", "1", "--report", str(report_path),
                  "--workdir", str(tmp_path / "wd"), timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (step,) = json.loads(report_path.read_text())["steps"]
    assert step["status"] == "skipped" and step["reason"].startswith("budget")
    if shutil.which("nvidia-smi") is None:  # a real run here refuses, in the report too
        refused = _check("--report", str(report_path), timeout=60)
        assert refused.returncode == 2 and "--dry-run" in refused.stderr
        assert json.loads(report_path.read_text())["steps"][0]["status"] == "fail"
