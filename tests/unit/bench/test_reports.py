"""The JSON of `bench async` and `bench peer`, assembled by their real `main` from recorded runs:
each rate's numerator and denominator are in the JSON and come from that row's own run (its
`learner.jsonl`), every row's window excludes the same warm-up steps, and each ratio is the
quotient of the two rows' rates as printed.

The outside edges stand in for what takes minutes: `agentrl run` (the bench's `_run`, which
launches it) writes a recorded `learner.jsonl` into the run directory it is given, as the real
learner does, and TRL's `GRPOTrainer` run (peer's `_trl`) returns the window of its recorded step
clock through the same `common.steady_rate` the real one calls. No run reads a model, so none is made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agentrl.bench import async_, peer
from agentrl.bench.common import steady_rate

# Seconds at the end of each learner step. The synchronous run steps every 2 s; the k = 2 run had
# three steps' groups ready before its first step (the backlog admission allows at version 0), so its
# first steps take 0.5 s, then it settles at 1.5 s; colocated runs at 3 s a step.
CLOCKS = {
    "k0": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0],
    "k2": [0.5, 1.0, 1.5, 3.0, 4.5, 6.0],
    "colocated": [3.0, 6.0, 9.0, 12.0, 15.0, 18.0],
    "trl": [4.0, 8.0, 12.0, 16.0, 20.0, 24.0],
}
REWARDS = {"k0": 0.5, "k2": 0.25, "colocated": 0.75, "trl": 0.125}


def _records(row: str, start: float = 1000.0) -> list[dict]:
    return [
        {"step": i + 1, "time": start + t, "reward/mean": REWARDS[row]} for i, t in enumerate(CLOCKS[row])
    ]


def _fake_run(runs: list[str]):
    """`_run` of the benches: the `agentrl run` it was asked for leaves its recorded learner.jsonl."""

    def run(args: list[str]) -> subprocess.CompletedProcess:
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--run_dir=")))
        k = next(a.split("=", 1)[1] for a in args if a.startswith("--max_staleness="))
        row = "colocated" if any("colocated" in a for a in args) else f"k{k}"
        runs.append(row)
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(r) for r in _records(row, start=1000.0 * len(runs))]  # each run its own clock
        (run_dir / "learner.jsonl").write_text("\n".join(lines) + "\n")
        return subprocess.CompletedProcess(args, 0, "", "")

    return run


def _json_line(out: str) -> dict:
    line = json.loads(out.strip().splitlines()[-1])
    assert set(line) == {"bench", "metrics", "ratios"}
    return line


def test_bench_async_rates_come_from_each_run_over_the_same_window(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    runs: list[str] = []
    monkeypatch.setattr(async_, "_run", _fake_run(runs))
    args = ["--ks", "0,2", "--steps", "3", "--groups-per-step", "2", "--model-dir", str(tmp_path),
            "--warmstart-steps", "0"]  # fmt: skip
    assert async_.main(args) == 0
    line = _json_line(capsys.readouterr().out)
    assert runs == ["k0", "k2"] and line["bench"] == "async"
    metrics, ratios = line["metrics"], line["ratios"]
    assert metrics["warmup_steps"] == 3  # the default: max k + 1, for every k alike
    for k in (0, 2):
        clock = CLOCKS[f"k{k}"]
        # the same warm-up excluded for every k: the window runs from the end of step 3 to the last
        assert (metrics[f"k{k}_window_from_step"], metrics[f"k{k}_window_to_step"]) == (3, 6)
        assert metrics[f"k{k}_window_samples"] == 3 * 2 * async_.GROUP_SIZE
        assert metrics[f"k{k}_window_seconds"] == pytest.approx(clock[5] - clock[2])  # this run's own clock
        assert metrics[f"k{k}_samples_per_s"] == pytest.approx(
            metrics[f"k{k}_window_samples"] / metrics[f"k{k}_window_seconds"]
        )
    assert ratios == {"k2_vs_sync": pytest.approx(metrics["k2_samples_per_s"] / metrics["k0_samples_per_s"])}
    assert ratios["k2_vs_sync"] == pytest.approx(6.0 / 4.5)  # not 12 / 6: the backlog is outside the window
    assert metrics["k2_final_reward"] == REWARDS["k2"]


def test_bench_peer_rates_come_from_each_run_over_the_same_window(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    runs: list[str] = []
    monkeypatch.setattr(peer, "_run", _fake_run(runs))

    def trl(model_dir: str, out: Path, opts, threads: int) -> dict:
        runs.append(f"trl/{threads}")
        window = steady_rate(_records("trl"), opts.warmup_steps, opts.prompts_per_step * opts.completions)
        return {**window, "final_reward": REWARDS["trl"]}

    monkeypatch.setattr(peer, "_trl", trl)
    # no run reads the model: the fresh tiny model peer makes for its rows is not needed here
    monkeypatch.setattr("agentrl.tiny_model.init_model", lambda preset, out: Path(out))
    args = ["--steps", "3", "--warmup-steps", "3", "--prompts-per-step", "2", "--completions", "4",
            "--trl-matched-threads", "3"]  # fmt: skip
    assert peer.main(args) == 0
    line = _json_line(capsys.readouterr().out)
    assert runs == ["trl/1", "trl/3", "k0", "k2", "colocated"] and line["bench"] == "peer"
    metrics, ratios = line["metrics"], line["ratios"]
    assert (
        metrics["warmup_steps"] == 3 and metrics["trl_threads"] == 1 and metrics["trl_matched_threads"] == 3
    )
    for row in ("trl", "trl_matched", "k0", "k2", "colocated"):
        clock = CLOCKS[row if row != "trl_matched" else "trl"]
        assert (metrics[f"{row}_window_from_step"], metrics[f"{row}_window_to_step"]) == (3, 6), row
        assert metrics[f"{row}_window_samples"] == 3 * 2 * 4
        assert metrics[f"{row}_window_seconds"] == pytest.approx(clock[5] - clock[2]), row
        assert metrics[f"{row}_samples_per_s"] == pytest.approx(
            metrics[f"{row}_window_samples"] / metrics[f"{row}_window_seconds"]
        )
    for row, name in (("k0", "sync_vs_trl"), ("k2", "async_vs_trl"), ("colocated", "colocated_vs_trl")):
        rate = metrics[f"{row}_samples_per_s"]
        assert ratios[name] == pytest.approx(rate / metrics["trl_samples_per_s"])
        assert ratios[f"{name}_matched"] == pytest.approx(rate / metrics["trl_matched_samples_per_s"])
    assert ratios["async_vs_trl"] == pytest.approx(12.0 / 4.5)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_bench_learner_ratios_are_quotients_of_the_raw_figures_it_reports(on_gpu: bool) -> None:
    from agentrl.bench.learner import summarize

    # tokens/s per measured step, as bench_preset records them (wall; and per CPU-second, where a
    # loaded machine stretches wall time more than CPU time)
    wall = {"ours": [90.0, 100.0, 95.0], "bare": [100.0, 110.0, 105.0], "packed": [80.0, 70.0, 75.0],
            "padded": [40.0, 50.0, 45.0], "ppo": [50.0, 45.0, 40.0], "megatron": [60.0, 65.0, 70.0]}  # fmt: skip
    cpu = {k: [2 * v + 10 for v in values] for k, values in wall.items()}
    out = summarize(wall, cpu, on_gpu)
    for name, key in (("ours", "ours"), ("bare", "bare_hf"), ("packed", "packed"), ("padded", "padded"),
                      ("ppo", "ppo"), ("megatron", "megatron")):  # fmt: skip
        assert out[f"{key}_tok_s"] == sorted(wall[name])[1]  # the median over the same steps
        assert out[f"{key}_tok_per_cpu_s"] == sorted(cpu[name])[1]
    rate = "tok_s" if on_gpu else "tok_per_cpu_s"
    for ratio, num, den in (("vs_bare_hf", "ours", "bare_hf"), ("packed_vs_padded", "packed", "padded"),
                            ("critic_cost", "ours", "ppo"), ("megatron_vs_fsdp2", "megatron", "ours")):  # fmt: skip
        assert out[ratio] == pytest.approx(out[f"{num}_{rate}"] / out[f"{den}_{rate}"]), ratio
        if ratio != "megatron_vs_fsdp2":
            assert out[f"{ratio}_wall"] == pytest.approx(out[f"{num}_tok_s"] / out[f"{den}_tok_s"]), ratio
    # the CPU basis is not the wall one here (on a GPU, the ratio is the wall one)
    assert (out["vs_bare_hf"] == pytest.approx(out["vs_bare_hf_wall"])) is on_gpu
