"""`agentrl bench NAME`: each module here measures ours against a baseline in one run.

A benchmark module exposes `main(args: list[str]) -> int`, prints a readable table and
ends with exactly one JSON line `{"bench": NAME, "metrics": {...}, "ratios": {...}}`
(use `agentrl.bench.common.emit`). Ratios are ours / baseline, higher is better.
"""
