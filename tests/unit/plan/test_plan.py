"""The planner's simulator and search: properties a capacity model must have, on small workloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentrl.config import load_config
from agentrl.plan.cli import SIZES, main
from agentrl.plan.profile import DEVICES, CostProfile, ModelShape
from agentrl.plan.search import Hardware, candidates, learner_memory, rank, server_memory
from agentrl.plan.sim import Deployment, simulate
from agentrl.plan.workload import Dist, Workload

GIB = 1024**3


def profile(**over) -> CostProfile:
    base = dict(
        decode_base_s=0.02, decode_per_seq_s=0.001, decode_per_ctx_token_s=1e-6, prefill_base_s=0.005,
        prefill_per_token_s=1e-4, train_base_s=0.5, learner_tokens_per_s=5000, push_base_s=0.1,
        push_bytes=4e8, push_bytes_per_s=1e9, reshard_s=0.3, max_batch=64,
    )  # fmt: skip
    return CostProfile(**{**base, **over})


def workload(k: int = 0, **over) -> Workload:
    base = dict(
        prompt_tokens=Dist.parse(50),
        response_tokens=Dist.parse({"kind": "lognormal", "median": 30, "p99": 200}),
        turns=Dist.parse(3),
        tool_latency_s=Dist.parse({"kind": "lognormal", "median": 0.1, "p99": 1.0}),
        group_size=4,
        groups_per_step=4,
        max_staleness=k,
    )
    return Workload(**{**base, **over})


def test_lognormal_matches_its_median_and_p99():
    import random

    d = Dist.parse({"kind": "lognormal", "median": 0.1, "p99": 1.0})
    rng = random.Random(0)
    xs = sorted(d.sample(rng) for _ in range(20000))
    assert xs[10000] == pytest.approx(0.1, rel=0.05)
    assert xs[19800] == pytest.approx(1.0, rel=0.1)


def test_one_sequence_alone_takes_the_closed_form_time():
    """One request of n tokens on an idle server: prefill, then n decode steps whose context grows."""
    p = profile(push_base_s=0.0, push_bytes=0.0, train_base_s=0.0, learner_tokens_per_s=1e12)
    w = Workload(
        prompt_tokens=Dist.parse(100), response_tokens=Dist.parse(50), group_size=1, groups_per_step=1
    )
    r = simulate(w, p, Deployment(servers=1, roller_concurrency=1), steps=3, warmup_steps=1)
    decode = sum(p.decode_s(1, 100 + i) for i in range(50))
    assert r.step_time_s == pytest.approx(p.prefill_s(100) + decode, rel=1e-9)


def test_more_servers_never_predict_less_for_generation_bound_work():
    w = workload(k=2)
    rates = [
        simulate(w, profile(), Deployment(servers=n, rollers=2), steps=10).samples_per_s for n in (1, 2, 4)
    ]
    assert rates[0] < rates[1] <= rates[2] * 1.001


def test_staleness_buys_throughput_and_is_bounded():
    rates, stale = [], []
    for k in (0, 1, 2):
        r = simulate(workload(k), profile(), Deployment(servers=2), steps=12)
        rates.append(r.samples_per_s)
        stale.append(r.mean_staleness)
        assert r.mean_staleness <= k
    assert rates[0] < rates[1] < rates[2]
    assert stale[0] == 0


def test_colocated_time_is_generation_plus_reshard_plus_training():
    """Colocated steps do not overlap: removing the reshard shortens each step by exactly it."""
    w = workload()
    a = simulate(w, profile(reshard_s=0.0), Deployment("colocated", servers=2), steps=6)
    b = simulate(w, profile(reshard_s=0.4), Deployment("colocated", servers=2), steps=6)
    assert b.step_time_s - a.step_time_s == pytest.approx(0.4, rel=1e-6)


def test_bad_deployments_are_refused():
    with pytest.raises(ValueError, match="roller_concurrency"):
        simulate(workload(), profile(), Deployment(roller_concurrency=2))
    with pytest.raises(ValueError, match="kind"):
        Dist.parse({"kind": "pareto"})
    with pytest.raises(ValueError, match="unknown workload field"):
        Workload.from_dict({"group_sizes": 4})


def test_search_respects_memory_limits():
    model = ModelShape.from_hf_config(SIZES["72b"])
    hw = Hardware(DEVICES["h100"], 64)
    w = Workload(max_total_tokens=4096)
    limit = DEVICES["h100"].memory_bytes * 0.9
    found = list(candidates(model, hw, w, (0,), 256))
    assert found
    for c in found:
        assert learner_memory(model, w, c.learner_gpus, c.learner_tp, c.learner_pp) <= limit
        if c.mode == "decoupled":
            assert server_memory(model, w, c.server_tp) <= limit
            assert c.gpus <= 64
    # 72B's weights (145 GB) need two H100s to serve; its training state (16 bytes a parameter,
    # 1.16 TB) needs 16 of them, and then only with tensor parallel shrinking the activations
    assert all(c.server_tp >= 2 for c in found)
    assert min(c.learner_gpus for c in found) == 16
    assert all(c.backend == "megatron" for c in found if c.learner_gpus == 16)


def test_seven_b_on_sixty_four_gpus_writes_a_config_agentrl_validates(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    wl = tmp_path / "w.yaml"
    wl.write_text(yaml.safe_dump({"response_tokens": {"kind": "lognormal", "median": 200, "p99": 1500},
                                  "turns": 2, "groups_per_step": 16, "group_size": 8}))  # fmt: skip
    assert main(["--model", "7b", "--gpus", "64", "--workload", str(wl), "--k", "0", "2", "--top", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "samples/s" in table and "decoupled" in table
    config = load_config(out, [])
    assert config.launcher.type == "ray"
    assert config.learner.groups_per_step == 16


def test_ranked_best_first():
    model = ModelShape.from_hf_config(SIZES["1.5b"])
    ranked = rank(model, Hardware(DEVICES["h100"], 8), Workload(groups_per_step=4), ks=(0, 2), top=10)
    rates = [r.result.samples_per_s for r in ranked]
    assert rates == sorted(rates, reverse=True)
    assert {r.candidate.mode for r in ranked} <= {"colocated", "decoupled"}
    assert all(r.learner_memory < 80 * GIB for r in ranked)


def test_pareto_matches_the_toy_envs_latency():
    """The toy envs' ParetoLatency (envs/toy.py) and the planner's `pareto` draw the same law."""
    import asyncio
    import random
    import statistics

    from agentrl.envs.toy import ParetoLatency

    d = Dist.parse({"kind": "pareto", "median": 0.3, "alpha": 1.5, "high": 10.0})
    rng = random.Random(0)
    ours = sorted(d.sample(rng) for _ in range(40000))
    env = ParetoLatency(0.3, 1.5, 10.0)
    delays = []

    async def fake_sleep(s):
        delays.append(s)

    real = asyncio.sleep
    asyncio.sleep = fake_sleep
    try:
        for _ in range(40000):
            asyncio.run(env.sleep())
    finally:
        asyncio.sleep = real
    delays.sort()
    assert statistics.median(ours) == pytest.approx(statistics.median(delays), rel=0.05)
    assert d.mean() == pytest.approx(sum(delays) / len(delays), rel=0.05)


def test_shared_cores_slow_what_overlaps():
    """On a CPU machine (cores > 0) servers and learner share cores: fewer cores, slower; enough
    cores for every busy thread, as fast as separate devices. (Constant lengths and latencies: with
    random ones a different order of events draws a different workload.)"""
    w = workload(k=2, response_tokens=Dist.parse(40), tool_latency_s=Dist.parse(0.2))
    d = Deployment(servers=1)
    free = simulate(w, profile(), d, steps=10).samples_per_s
    one = simulate(w, profile(cores=1, learner_threads=1), d, steps=10).samples_per_s
    many = simulate(w, profile(cores=8, learner_threads=1), d, steps=10).samples_per_s
    assert one < free
    assert many == pytest.approx(free, rel=1e-9)


def test_bench_plan_scenarios_name_env_and_mode():
    from agentrl.bench.plan import Scenario, _colocated_replicas, _scenario, scenario_names

    assert _scenario("tail:k2") == Scenario("tail", 2, 1, False)
    assert _scenario("quick:k1r2") == Scenario("quick", 1, 2, False)
    assert _scenario("quick:colo") == Scenario("quick", 0, 1, True)
    for bad in ("k1", "x:k1", "tail:x1", "tail:k1r0", "tail:k", "tail:colocated"):
        with pytest.raises(ValueError, match="scenario"):
            _scenario(bad)
    # the default matrix: both envs × k 0, 1, 2, two rollers, colocated
    default = scenario_names("quick,tail", "k0,k1,k2,k1r2,colo")
    assert len(default) == 10 and "quick:colo" in default and "tail:k1r2" in default
    assert scenario_names("quick,tail", "tail:colo,k0") == ["tail:colo", "quick:k0", "tail:k0"]
    assert _colocated_replicas() == 2  # the colocated recipe's two ranks, one replica each (tg 1)


def test_bench_plan_predicts_from_a_runs_own_shape():
    from types import SimpleNamespace

    from agentrl.bench.plan import _predict

    opts = SimpleNamespace(latency_s=0.3, groups_per_step=4, concurrency=32, warmup_steps=2, steps=4)
    measured = {"shape": {"len": 120.0, "generated": 30.0, "turns": 2.0}, "replicas": 0}
    slow = _predict("tail:k1", measured, profile(), opts)
    fast = _predict("tail:k2", measured, profile(), opts)
    assert 0 < slow < fast
    # the quickstart's tool answers at once: the same shape runs faster than behind the slow tool
    assert _predict("quick:k1", measured, profile(), opts) > slow


def test_bench_plan_colocated_prediction_uses_the_colocated_costs():
    """The colocated scenario is simulated as colocated: its measured reshard, learner rate and loop
    cost each lengthen the predicted step; the measured run's replicas are its servers."""
    from types import SimpleNamespace

    from agentrl.bench.plan import _predict, report

    opts = SimpleNamespace(latency_s=0.3, groups_per_step=4, concurrency=32, warmup_steps=2, steps=4)
    measured = {"shape": {"len": 60.0, "generated": 24.0, "turns": 1.0}, "replicas": 2, "samples_per_s": 4.0}
    base = profile(reshard_s=0.0, colocated_tokens_per_s=2000.0)
    fast = _predict("quick:colo", measured, base, opts)
    assert fast > _predict(
        "quick:colo", measured, profile(reshard_s=0.5, colocated_tokens_per_s=2000.0), opts
    )
    assert fast > _predict("quick:colo", measured, profile(colocated_tokens_per_s=500.0, reshard_s=0.0), opts)
    assert fast > _predict("quick:colo", measured, profile(reshard_s=0.0, colocated_tokens_per_s=2000.0,
                                                           colocated_loop_s=0.3), opts)  # fmt: skip
    # one replica generates slower than two
    assert fast > _predict("quick:colo", {**measured, "replicas": 1}, base, opts)
    metrics, ratios = report(["quick:colo"], {"quick:colo": measured}, {"quick:colo": fast}, base)
    assert metrics["quick:colo"]["measured"]["samples_per_s"] == 4.0
    assert metrics["quick:colo"]["predicted_samples_per_s"] == fast
    assert ratios == {"quick:colo_predicted_vs_measured": fast / 4.0}
    assert metrics["profile"]["colocated_tokens_per_s"] == 2000.0


def test_colocated_calibration_reads_a_runs_phases(tmp_path, monkeypatch):
    """`calibrate_colocated` reads reshard + release, the learner's tokens/s and the loop's remainder
    from the run's learner.jsonl, after its first step. (The run itself is replaced by one that
    writes the records a colocated run logs, agentrl/colocated/loop.py's keys.)"""
    import json
    import subprocess

    from agentrl.plan import calibrate as cal

    config = tmp_path / "colo.yaml"
    config.write_text("mode: colocated\n")
    steps = [  # (time, generation, reshard, release, train, tokens/s); the first is a warm-up
        (100.0, 5.0, 2.0, 0.1, 9.0, 100.0),
        (103.0, 1.0, 0.2, 0.1, 1.5, 1000.0),
        (106.2, 1.1, 0.3, 0.1, 1.5, 1200.0),
        (109.2, 1.0, 0.2, 0.1, 1.5, 1100.0),
    ]

    class FakeRun:
        def __init__(self, args, **_):
            run_dir = Path(next(a for a in args if a.startswith("--run_dir=")).split("=", 1)[1])
            run_dir.mkdir(parents=True)
            with open(run_dir / "learner.jsonl", "w") as f:
                for i, (t, g, r, rel, tr, rate) in enumerate(steps, 1):
                    f.write(json.dumps({"step": i, "time": t, "time/generation_s": g, "time/reshard_s": r,
                                        "time/release_s": rel, "time/train_s": tr, "tokens_per_s": rate}) + "\n")  # fmt: skip
            self.returncode = 0

        def communicate(self):
            return "", ""

    monkeypatch.setattr(subprocess, "Popen", FakeRun)
    out = cal.calibrate_colocated("model", tmp_path, config, steps=4)
    assert out["reshard_s"] == pytest.approx(0.3)  # median of 0.3, 0.4, 0.3
    assert out["colocated_tokens_per_s"] == pytest.approx(1100.0)
    # step 3: 3.2 - (1.1 + 0.3 + 0.1 + 1.5) = 0.2; step 4: 3.0 - 2.8 = 0.2
    assert out["colocated_loop_s"] == pytest.approx(0.2)
    assert "colocated" in out["source"]
    with pytest.raises(ValueError, match="3 steps"):
        cal.calibrate_colocated("model", tmp_path, config, steps=2)
    with pytest.raises(FileNotFoundError):
        cal.calibrate_colocated("model", tmp_path, tmp_path / "missing.yaml")
