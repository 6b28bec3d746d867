"""One logger and one metrics interface for the whole project.

`get_logger(name)` gives a logger under the `agentrl` namespace with one consistent
format. `MetricsLogger.log(metrics, step)` writes scalar metrics to every configured
sink: JSONL always (one object per line, with step and wall time), TensorBoard,
Weights & Biases and MLflow (`agentrl/observe/mlflow_sink.py`) when asked for and installed.
`MetricsLogger.log_text(texts, step)` sends longer text (the learner's transcripts) to
TensorBoard and W&B only; its JSONL is the caller's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Callable
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


def _plain(value: Any) -> Any:
    """numpy / torch scalars as Python numbers, arrays and tensors as (nested) lists."""
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # more than one element
            return value.tolist() if hasattr(value, "tolist") else str(value)
    return value


def _jsonable(value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible rather than dropping it
    return value


def _number(value: Any) -> int | float | None:
    """The value as one int/float (NaN and inf included) for the scalar sinks, else None."""
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, (int, float)) else None


def _drop_sink(name: str, close: Callable[[], Any]) -> None:
    get_logger("metrics").exception("the %s metrics sink failed; continuing without it", name)
    with contextlib.suppress(Exception):
        close()


class MetricsLogger:
    """`log(metrics, step)` to JSONL plus optional TensorBoard / W&B / MLflow sinks.

    JSONL gets every value (non-finite floats as "nan"/"inf" strings, arrays as lists, other
    objects as their str). TensorBoard and MLflow get the numbers (NaN and inf as such); W&B gets
    the numbers and strings. MLflow is on when `mlflow_tracking_uri` is given. An optional sink
    that raises mid-run is reported once and disabled; training never stops for a dashboard."""

    def __init__(
        self,
        run_dir: str | Path,
        name: str = "metrics",
        tensorboard: bool = False,
        wandb_project: str | None = None,
        mlflow_tracking_uri: str | None = None,
        mlflow_experiment: str = "agentrl",
    ) -> None:
        self.path = Path(run_dir) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        self._wandb = None
        self._mlflow = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "tensorboard logging needs the tensorboard package: pip install 'agentrl[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("W&B logging needs the wandb package: pip install 'agentrl[wandb]'") from e
            # WANDB_MODE=offline writes the run under <run_dir>/wandb for a later `wandb sync`.
            # The run id lives in the run directory, so a resumed run (`--resume`) continues the
            # same W&B run instead of starting a new one.
            id_file = Path(run_dir) / f"{name}.wandb_id"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), id=run_id, resume="allow")
        if mlflow_tracking_uri:
            from agentrl.observe.mlflow_sink import MlflowSink

            self._mlflow = MlflowSink(Path(run_dir), name, mlflow_tracking_uri, mlflow_experiment)

    @classmethod
    def from_config(cls, run_dir: str | Path, name: str, logging: Any) -> MetricsLogger:
        """With the sinks a `learner.logging` section (`LoggingConfig`) turns on."""
        mlflow = logging.mlflow
        return cls(run_dir, name, logging.tensorboard, logging.wandb_project,
                   mlflow_tracking_uri=mlflow.tracking_uri, mlflow_experiment=mlflow.experiment)  # fmt: skip

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = {str(k): _plain(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, default=str) + "\n")
        numbers = {k: n for k, v in values.items() if (n := _number(v)) is not None}
        if self._tb is not None:
            try:
                for key, value in numbers.items():
                    self._tb.add_scalar(key, value, step)
            except Exception:
                self._tb = _drop_sink("tensorboard", self._tb.close)
        if self._wandb is not None:
            strings = {k: v for k, v in values.items() if isinstance(v, str)}
            try:
                self._wandb.log({**numbers, **strings}, step=step)
            except Exception:
                self._wandb = _drop_sink("wandb", self._wandb.finish)
        if self._mlflow is not None:
            try:
                self._mlflow.log(numbers, step)
            except Exception:
                self._mlflow = _drop_sink("mlflow", lambda: self._mlflow.close("FAILED"))

    def log_text(self, texts: dict[str, str], step: int) -> None:
        """Text under each key: TensorBoard's text tab, W&B as preformatted HTML."""
        if self._tb is not None:
            try:
                for key, text in texts.items():
                    self._tb.add_text(key, "    " + text.replace("\n", "\n    "), step)  # markdown code block
            except Exception:
                self._tb = _drop_sink("tensorboard", self._tb.close)
        if self._wandb is not None:
            import html

            import wandb

            try:
                self._wandb.log(
                    {k: wandb.Html(f"<pre>{html.escape(t)}</pre>") for k, t in texts.items()}, step=step
                )
            except Exception:
                self._wandb = _drop_sink("wandb", self._wandb.finish)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.close()
            self._mlflow = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read back a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_metrics(path: str | Path) -> dict[str, Any]:
    """The last record of a metrics JSONL file being written (read from its tail); {} if none yet."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
