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
    assert {"tokens_per_s_c1", "tokens_per_s_c8", "tokens_per_s_c32"} <= set(line["metrics"])
