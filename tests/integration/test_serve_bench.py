"""`agentrl bench serve` runs end to end and ends with the JSON line its interface promises."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_bench_serve_reports_ratios():
    out = run_agentrl("bench", "serve", "--requests", "32", "--max-new-tokens", "4", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "serve"
    assert set(line["ratios"]) == {"c8_vs_c1", "c32_vs_c1"}
    assert all(v > 0 for v in line["ratios"].values())
    metrics = line["metrics"]
    for c in (1, 8, 32):  # each rate's numerator and denominator, from this run, the same work at each level
        assert metrics[f"requests_c{c}"] == 32 and metrics[f"tokens_c{c}"] == 32 * 4
        assert metrics[f"tokens_per_s_c{c}"] == pytest.approx(
            metrics[f"tokens_c{c}"] / metrics[f"seconds_c{c}"]
        )
    for c in (8, 32):
        assert line["ratios"][f"c{c}_vs_c1"] == pytest.approx(
            metrics[f"tokens_per_s_c{c}"] / metrics["tokens_per_s_c1"]
        )
