"""Launchers of `agentrl run`, the only package that starts processes: one plan (`plan.py`) of what
to start, executed on this machine (`local.py`, over the `Supervisor` of `procs.py`) or on a Ray
cluster (`ray.py`); `control.py` is how `agentrl scale` and `agentrl status` talk to a running
launcher through its run directory."""
