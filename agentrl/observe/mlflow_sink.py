"""The MLflow sink of `MetricsLogger`: each `log(metrics, step)` becomes one `log_batch` of the
step's numbers in one MLflow run.

The tracking store is whatever `learner.logging.mlflow.tracking_uri` names: a local
`sqlite:///runs/mlflow.db`, or a tracking server `http://127.0.0.1:5000`. The run's id is kept in
`<run_dir>/<name>.mlflow_id`, so a resumed run (`--resume`) continues the same MLflow run, as the
W&B sink does. Only numbers go to MLflow (NaN and inf as such; booleans as 0/1), under their
names with any character MLflow refuses as `_`; strings, lists and transcripts stay in the JSONL
files. Needs `pip install 'agentrl[mlflow]'` (`mlflow-skinny`, plus
SQLAlchemy and Alembic for a local SQLite store).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

_NOT_IN_KEYS = re.compile(r"[^\w\-. :/]")  # what MLflow refuses in a metric name


class MlflowSink:
    """One MLflow run, created (or, with a run id file, resumed) in `experiment`."""

    def __init__(self, run_dir: Path, name: str, tracking_uri: str, experiment: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("MLflow logging needs mlflow-skinny: pip install 'agentrl[mlflow]'") from e
        self.client = MlflowClient(tracking_uri=tracking_uri)
        id_file = run_dir / f"{name}.mlflow_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(
                experiment_id, run_name=f"{run_dir.name}-{name}", tags={"agentrl.run_dir": str(run_dir)}
            )
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id)

    def log(self, numbers: dict[str, int | float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(_NOT_IN_KEYS.sub("_", key), float(value), now, step) for key, value in numbers.items()
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self, status: str = "FINISHED") -> Any:
        self.client.set_terminated(self.run_id, status=status)
