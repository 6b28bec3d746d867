"""What operators read while a run goes: the MLflow metrics sink (`mlflow_sink.py`) and the
Prometheus `/metrics` endpoints of the learner, the queue, the rollers and the embedded inference
server (`prometheus.py`). Both import their library only when configured."""
