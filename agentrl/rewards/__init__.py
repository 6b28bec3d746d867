"""Reward models: a served scorer (`agentrl serve-reward`) and the roller's client of it.

`config.py` holds the run's `reward` section, `server.py` the scoring service (a sequence
classifier's scalar head, or a generative judge's verdict probability), `client.py` what the
roller calls, and `batching.py` the micro-batcher both sides use.
"""
