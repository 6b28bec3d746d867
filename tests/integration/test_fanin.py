"""`agentrl bench fanin` at a reduced size: many producers (each its own lease) over two processes,
one hosted queue, stand-in servers behind the rollers' routers, the live list changing mid-run.
What must hold at any fan-in: no roller errors, the queue's credit and group accounts balance,
every list epoch reaches every roller process, and the learner trains. (The full size, 1,000
rollers and 64 servers, is run by hand; its numbers are in the README.)"""

from __future__ import annotations

import json

from agentrl.bench.fanin import main


def test_fanin_keeps_the_account_and_the_live_list_at_reduced_size(capsys):
    rc = main(
        ["--rollers", "12,48", "--procs", "2", "--servers", "8", "--seconds", "6", "--list-every-s", "1.5"]
    )
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, report
    runs = report["metrics"]["runs"]
    assert [r["rollers"] for r in runs] == [12, 48]
    for r in runs:
        assert r["errors"] == []
        assert r["account_residuals"] == {"credits": 0, "groups": 0, "leased_at_end": 0}
        assert r["list_epochs"] >= 2 and r["list_epochs_missed"] == []
        assert r["puts"] > 0 and r["acked"] > 0 and r["learner_steps"] > 0
        assert r["admissions"] >= r["puts"]
        assert r["requests"] >= r["puts"] * 2  # --turns 2: each put group made its requests first
    # the ratio is the quotient of the two runs' own figures
    base, big = runs
    ratio = report["ratios"]["cpu_per_group_48_vs_12"]
    assert abs(ratio - big["queue_cpu_per_group_ms"] / base["queue_cpu_per_group_ms"]) < 1e-9
