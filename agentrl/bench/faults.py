"""`agentrl bench faults`: how long the system takes to recover from a kill -9, and what it lost.

    agentrl bench faults [--steps 8] [--scenarios server,server_of_two,roller,learner]
    agentrl bench faults --steps 4 --scenarios server --model tiny

Each scenario runs `agentrl run` on the quickstart, shortened (no warm start, groups_per_step 4,
group_size 4, a fresh model of `--model` size), kills one process with SIGKILL once the learner
has trained `--kill-after` steps, and lets the run finish:

- `server`: the only inference server (the launcher restarts it on its port; the learner pushes
  the current weights to it while it waits for data; rollers wait for it, bounded);
- `server_of_two`: one of two servers (rollers fail over; it rejoins when restarted);
- `roller`: the only roller (restarted by the launcher);
- `learner`: the learner, with a durable queue (`agentrl run` stops; `agentrl run --resume`
  continues from the last checkpoint, one per step here, and the queue's write-ahead log).

Printed per scenario: seconds from the kill to the next trained step (`recovery_s`: the first
learner record written after the kill) and the run's per-group-id account, as the fault suite
computes it (`agentrl/queue/account.py`, read from the ledgers the queue, learner
and rollers write): `lost` (acknowledged to a roller, yet neither trained, nor dropped and
counted, nor still held by the queue), `duplicated` (trained more than once) and
`leaked_credits` (admission credits the queue cannot account for at the end). The learner
scenario's queue is durable, so no group is lost with durability off (`lost_undurable`) either.
The bench runs from a checkout (it reads `recipes/quickstart.yaml`). There is no baseline to
compare with in one run: `ratios` is empty.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.bench.common import emit, print_table
from agentrl.log import read_metrics
from agentrl.net import free_port

REPO = Path(__file__).resolve().parents[2]

SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "server": ("server0", []),
    "server_of_two": ("server1", ["--inference.num_servers=2"]),
    "roller": ("roller0", []),
    "learner": ("learner", ["--queue.durable=true"]),
}


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "learner.jsonl"
    return read_metrics(path) if path.exists() else []


def _pid(log: Path, name: str) -> int:
    found = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{name} was never started; see {log}")
    return int(found[-1])


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:  # timed out or interrupted: stop it and its children (own session)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def account(run_dir: Path) -> dict[str, int]:
    """lost / duplicated / leaked_credits of a finished run (see the module docstring)."""
    from agentrl.queue.account import account as group_account

    acct = group_account(run_dir)
    return {"lost": acct.lost, "duplicated": acct.duplicated, "leaked_credits": acct.leaked_credits}


def one_scenario(name: str, tmp: Path, model: str, opts: argparse.Namespace) -> dict:
    victim, extra = SCENARIOS[name]
    run_dir, log = tmp / name, tmp / f"{name}.log"
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        f"--max_staleness={opts.k}", f"--learner.model_path={model}", f"--learner.max_steps={opts.steps}",
        "--learner.groups_per_step=4", "--learner.warmstart.steps=0", "--learner.batch_timeout_s=1",
        "--learner.checkpoint.every=1", "--roller.group_size=4", "--roller.max_turns=2",
        "--roller.max_concurrent_episodes=16", "--inference.health_check_interval_s=1",
        "--launcher.restart_backoff_s=0.5", f"--queue.address=tcp://127.0.0.1:{free_port()}", *extra,
    ]  # fmt: skip
    proc = _start(args, log)
    deadline = time.monotonic() + opts.timeout_s
    while len(_steps(run_dir)) < opts.kill_after:
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                _finish(proc, 0.1)
            raise RuntimeError(f"{name}: training did not reach step {opts.kill_after}; see {log}")
        time.sleep(0.1)
    killed_at = time.time()
    os.kill(_pid(log, victim), signal.SIGKILL)
    code = _finish(proc, opts.timeout_s)
    if name == "learner":  # its death ends the run; --resume continues it
        if code == 0:
            raise RuntimeError(f"{name}: agentrl run exited 0 after its learner was killed; see {log}")
        code = _finish(_start([*args, "--resume"], log), opts.timeout_s)
    if code != 0:
        raise RuntimeError(f"{name}: agentrl run exited with code {code}; see {log}")
    after = [r for r in _steps(run_dir) if r["time"] > killed_at]
    return {"recovery_s": after[0]["time"] - killed_at if after else float("nan"), **account(run_dir)}


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench faults")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=2, help="learner steps before the kill")
    parser.add_argument("--k", type=int, default=1, help="max_staleness")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--model", default="mini", help="model preset (agentrl init-model)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per scenario run")
    opts = parser.parse_args(args)
    names = [s.strip() for s in opts.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    if not 1 <= opts.kill_after < opts.steps:
        parser.error("--kill-after must be at least 1 and below --steps (a step must follow the kill)")

    from agentrl.tiny_model import init_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM stops the child run too
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-faults-") as tmp:
        model = str(init_model(opts.model, Path(tmp) / "model"))
        results = {n: one_scenario(n, Path(tmp), model, opts) for n in names}

    print_table(
        f"kill -9, then recovery: {opts.steps} steps × 4 groups × 4 episodes, max_staleness {opts.k}, "
        f"kill after step {opts.kill_after}",
        ["scenario", "seconds to next trained step", "lost", "trained twice", "leaked credits"],
        [[n, r["recovery_s"], r["lost"], r["duplicated"], r["leaked_credits"]] for n, r in results.items()],
    )
    metrics: dict = {f"recovery_s_{n}": r["recovery_s"] for n, r in results.items()}
    for key in ("lost", "duplicated", "leaked_credits"):
        metrics[key] = sum(r[key] for r in results.values())
    emit("faults", metrics, {})
    return 0
