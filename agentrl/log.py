"""One logger and one metrics interface for the whole project.

`get_logger(name)` gives a logger under the `agentrl` namespace with one consistent
format. `MetricsLogger.log(metrics, step)` writes scalar metrics to every configured
sink: JSONL always (one object per line, with step and wall time), TensorBoard and
Weights & Biases when asked for and installed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger named `agentrl.<name>`; the root `agentrl` logger is set up once."""
    root = logging.getLogger("agentrl")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("AGENTRL_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return root if name == "agentrl" else root.getChild(name.removeprefix("agentrl."))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible rather than dropping it
    return value


class MetricsLogger:
    """`log(metrics, step)` to JSONL plus optional TensorBoard / W&B sinks."""

    def __init__(
        self,
        run_dir: str | Path,
        name: str = "metrics",
        tensorboard: bool = False,
        wandb_project: str | None = None,
    ) -> None:
        self.path = Path(run_dir) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(_jsonable(value), (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read back a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
