"""Colocated mode: generation and training on the same ranks, the actor switching layouts each step."""
