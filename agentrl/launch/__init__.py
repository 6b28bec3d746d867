"""Launchers of `agentrl run`: one plan (`plan.py`) of what to start, executed on this machine
(`agentrl/launcher.py`) or on a Ray cluster (`ray.py`); `control.py` is how `agentrl scale` and
`agentrl status` talk to a running launcher through its run directory."""
