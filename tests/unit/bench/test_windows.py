"""The steady-state window every throughput bench times its runs over (`common.steady_rate`)."""

from __future__ import annotations

import pytest

from agentrl.bench.common import steady_rate


def _records(step_times: list[float]) -> list[dict]:
    return [{"step": i + 1, "time": t} for i, t in enumerate(step_times)]


def test_every_k_excludes_the_same_warm_up_so_a_backlog_does_not_inflate_the_rate() -> None:
    # Synthetic runs of 6 steps at a steady 2 s per step. The synchronous run (k=0) starts
    # generating at step 0; the k=2 run's rollers had 3 steps' groups done before the learner's
    # first step, so its first three steps take only the 0.5 s of training each, then it settles
    # at the same 2 s per step. Timing from the first record (the old window) shows k=2 faster;
    # excluding the same 3 warm-up steps for both shows what the steady state is: equal.
    sync = _records([2.0, 4.0, 6.0, 8.0, 10.0, 12.0])
    backlog = _records([0.5, 1.0, 1.5, 3.5, 5.5, 7.5])
    naive = {name: steady_rate(r, 1, 4)["samples_per_s"] for name, r in (("sync", sync), ("k2", backlog))}
    assert naive["k2"] > 1.4 * naive["sync"]  # the bias the window removes
    windows = {name: steady_rate(r, 3, 4) for name, r in (("sync", sync), ("k2", backlog))}
    for window in windows.values():
        assert (window["from_step"], window["to_step"]) == (3, 6)  # the same steps for both
        assert window["samples"] == 4 * 3 and window["seconds"] == pytest.approx(6.0)
        assert window["samples_per_s"] == pytest.approx(window["samples"] / window["seconds"])
    assert windows["k2"]["samples_per_s"] == pytest.approx(windows["sync"]["samples_per_s"])


def test_a_run_too_short_for_its_warm_up_is_an_error_not_a_zero_rate() -> None:
    with pytest.raises(ValueError, match="at least warmup_steps \\+ 1 steps"):
        steady_rate(_records([1.0, 2.0, 3.0]), 3, 4)
    with pytest.raises(ValueError, match="at least 1"):
        steady_rate(_records([1.0, 2.0]), 0, 4)
