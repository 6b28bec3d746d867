"""The main loop both launchers share (`watch`: supervise, apply `agentrl scale`, rewrite the state
`agentrl status` reads), its live progress table, and the plot and paths printed when a run ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.launch.control import ScaleWatch, write_state
from agentrl.log import get_logger, last_metrics, read_metrics

logger = get_logger(__name__)


def watch(
    config: AgentRLConfig,
    kind: str,
    supervise_once: Callable[[], str | None],
    apply_scale: Callable[[Any], Any],
    processes: Callable[[], list],
    restarts: Callable[[], int],
    **state: Any,
) -> int:
    """Both launchers' main loop, every 0.5 s: one supervision round (`"done"`, `"failed"` or None),
    a pending `agentrl scale` request applied, the state `agentrl status` reads rewritten (`state`:
    extra fields of it), the live table refreshed. 0 when the run is done, 1 when it failed."""
    from rich.live import Live

    run_dir = Path(config.run_dir)
    scale, last, outcome = ScaleWatch(run_dir), None, None
    live = Live(progress_table(run_dir, config), refresh_per_second=1, transient=False)
    try:
        with live:
            while outcome not in ("done", "failed"):
                outcome = supervise_once()
                request = scale.poll()
                if request is not None and outcome is None:
                    last = apply_scale(request)
                write_state(run_dir, kind, processes(), scale=last, scale_id=scale.last_id, **state)
                live.update(progress_table(run_dir, config, restarts()))
                if outcome is None:
                    time.sleep(0.5)
    finally:
        if not live.console.is_terminal:
            live.console.line()  # off a terminal, the last render ends without a newline
    if outcome == "failed":
        return 1
    finish(run_dir)
    return 0


def exit_code(body: Callable[[], int]) -> int:
    """Run a launcher's start-up and main loop: its own exit code, 130 on Ctrl-C / SIGTERM, 1 (the
    error logged) when a process failed to start or the supervision gave up. The caller stops
    what was started, whichever way `body` ended."""
    try:
        return body()
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every process")
        return 130
    except (RuntimeError, TimeoutError) as exc:
        logger.error("%s", exc)
        return 1


def progress_table(run_dir: Path, config: AgentRLConfig, restarts: int = 0):
    """One table from the learner's and rollers' metrics records."""
    from rich.table import Table

    learner = last_metrics(run_dir / "learner.jsonl")
    rollers = [last_metrics(p) for p in sorted(run_dir.glob("roller*.jsonl"))]
    table = Table(title=f"agentrl run — {run_dir}", show_header=False)
    step = learner.get("step", 0)
    table.add_row("step / version", f"{step} / {config.learner.max_steps}")
    table.add_row("reward (last batch)", _fmt(learner.get("reward/mean")))
    table.add_row("staleness (mean / max in batch)", "{} / {}".format(*map(_fmt, staleness(learner))))
    table.add_row("episodes/s (all rollers)", _fmt(sum(r.get("roller/episodes_per_s", 0.0) for r in rollers)))
    table.add_row("queue depth", _fmt(learner.get("queue/depth")))
    table.add_row("weight push (s)", _fmt(learner.get("sync/push_s")))
    table.add_row("restarts (servers, rollers)", str(restarts))
    flat, limit = learner.get("reward/flat_steps", 0), config.learner.logging.flat_reward_steps
    if limit and flat >= limit:
        table.add_row("[bold yellow]warning[/]", f"[yellow]every group's rewards equal for {flat:.0f} steps: "
                      f"nothing to learn from; see agentrl show transcripts {run_dir}[/]")  # fmt: skip
    return table


def staleness(record: dict) -> tuple[float | None, int | None]:
    """(mean, max) staleness of a learner record's batch, from its `staleness/<k>` histogram."""
    hist = {
        int(k.split("/")[1]): v for k, v in record.items() if k.startswith("staleness/") and k[10:].isdigit()
    }
    total = sum(hist.values())
    if not total:
        return None, None
    return sum(k * n for k, n in hist.items()) / total, max(k for k, n in hist.items() if n)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))


def finish(run_dir: Path) -> Path | None:
    """Plot reward and staleness per step; print where the records are."""
    path = run_dir / "learner.jsonl"
    if not path.exists():
        return None
    records = read_metrics(path)
    plot = run_dir / "reward_staleness.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written")
        plot = None
    if plot is not None and records:
        steps = [r["step"] for r in records]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        ax1.plot(steps, [r.get("reward/mean", float("nan")) for r in records])
        ax1.set_ylabel("mean reward")
        mean_max = [staleness(r) for r in records]
        ax2.plot(steps, [m if m is not None else float("nan") for m, _ in mean_max], label="mean")
        ax2.plot(steps, [x if x is not None else float("nan") for _, x in mean_max], label="max")
        ax2.set_ylabel("staleness (versions)")
        ax2.set_xlabel("learner version")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(plot)
        plt.close(fig)
    print(f"metrics: {path}")
    if plot is not None:
        print(f"plot:    {plot}")
    return plot
