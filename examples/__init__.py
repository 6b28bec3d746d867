"""Example environments referenced from the README."""
