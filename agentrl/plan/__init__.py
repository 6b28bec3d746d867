"""Capacity planning: a discrete-event model of a run (`sim.py`) fed by a workload (`workload.py`)
and a cost profile (`profile.py`), and a search over deployments of a cluster (`search.py`) behind
`agentrl plan` (`cli.py`)."""
