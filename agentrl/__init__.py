"""agentrl: reinforcement learning for multi-turn, tool-calling LLM agents.

Rollers run episodes against inference servers and sandboxed environments and stream
trajectories to an FSDP2 learner, which pushes weights back with bounded staleness.
See README.md and docs/architecture.md.
"""

__version__ = "0.1.0"
