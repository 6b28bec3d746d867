"""Colocated mode: the actor trains and generates on the same ranks, and the HybridEngine
reshards it between the two layouts (layout.py: the rank maps; tp.py: the TP plan; reshard.py:
the reshard itself)."""
