"""A two-lookup tool task written once for two trainers: agentrl's `ToolEnv` and TRL's
`GRPOTrainer(environment_factory=...)`. `agentrl bench peer --agentic` trains both on it.

Each task hides a fresh table of animal → colour and asks for the colours of two of its animals
(`What colours are the tiger and the otter?`). Only the `lookup` tool can read the table, so an
episode that answers right makes two tool calls, one per animal (Hermes/Qwen `<tool_call>` JSON,
which both trainers parse from the same chat template), then names both colours. The reward,
`lookup_reward`, is the share of the two colours the final answer names (graded, so a model that
gets one right still has something to climb).

The tool takes time, as sandboxes and search engines do: every call sleeps a log-normal latency
(median `latency_s`, σ = `sigma`: with the defaults, 100 ms median and p99 ≈ 1 s), drawn from a
generator seeded by (`latency_seed`, task id, call index), so the same call of the same task waits
the same time whichever trainer makes it. Both wrappers call the one coroutine `lookup_colour`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
from typing import Any, ClassVar

from agentrl.envs.base import Transcript
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool
from agentrl.envs.toy import LOOKUP_KEYS, LOOKUP_VALUES

LATENCY_MEDIAN_S = 0.1
LATENCY_SIGMA = 0.99
"""log-normal σ for p99 ≈ 10 × the median: exp(2.326 σ) = 10 gives σ ≈ 0.99."""
MAX_LATENCY_S = 10.0


def tool_latency(seed: int, task_id: str, call: int, median_s: float, sigma: float) -> float:
    """The latency of call number `call` (0, 1, ...) of task `task_id`: log-normal, median
    `median_s`, capped at `MAX_LATENCY_S`; 0 when `median_s` is 0. Deterministic, so both
    trainers wait the same times on the same tasks."""
    if median_s <= 0:
        return 0.0
    rng = random.Random(f"{seed}:{task_id}:{call}")
    return min(MAX_LATENCY_S, rng.lognormvariate(math.log(median_s), sigma))


async def lookup_colour(table: dict[str, str], animal: str, latency_s: float) -> str:
    """The tool both trainers call: wait `latency_s`, then read `animal`'s colour from the table."""
    if latency_s > 0:
        await asyncio.sleep(latency_s)
    return table.get(animal.strip().lower(), f"unknown animal {animal!r}")


_WORD = re.compile(r"[a-z]+")


def lookup_reward(final_text: str, answers: list[str]) -> float:
    """Share of the task's colours that the final answer names (as whole words)."""
    words = set(_WORD.findall(final_text.lower()))
    return sum(colour in words for colour in answers) / len(answers)


def generate_lookup_tasks(num: int, seed: int = 0, table_size: int = 6) -> list[dict[str, Any]]:
    """`num` tasks, each with its own table and two distinct animals to look up."""
    rng = random.Random(seed)
    tasks = []
    for i in range(num):
        animals = rng.sample(LOOKUP_KEYS, table_size)
        table = {a: rng.choice(LOOKUP_VALUES) for a in animals}
        first, second = rng.sample(animals, 2)
        tasks.append(
            {
                "id": f"lookup2-{seed}-{i}",
                "question": f"What colours are the {first} and the {second}?",
                "animals": [first, second],
                "table": table,
                "answers": [table[first], table[second]],
            }
        )
    return tasks


class LookupToolsEnv(ToolEnv):
    """agentrl's side: a `ToolEnv` with one `lookup` tool (no system prompt: the chat template's
    default, as TRL renders it). `metrics["tool_seconds"]` is the time its calls waited."""

    required_task_fields = ("question", "table", "answers")

    def __init__(
        self,
        latency_s: float = LATENCY_MEDIAN_S,
        sigma: float = LATENCY_SIGMA,
        latency_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.latency_s, self.sigma, self.latency_seed = latency_s, sigma, latency_seed
        self._calls = 0
        self.metrics["tool_seconds"] = 0.0

    @tool
    async def lookup(self, animal: str) -> str:
        """Look up an animal's colour in today's table.

        Args:
            animal: The animal's name, e.g. "tiger".
        """
        delay = tool_latency(self.latency_seed, self.task["id"], self._calls, self.latency_s, self.sigma)
        self._calls += 1
        self.metrics["tool_seconds"] += delay
        return await lookup_colour(self.task["table"], animal, delay)

    def reward(self, transcript: Transcript) -> float:
        return lookup_reward(transcript.final_text, self.task["answers"])

    def demonstrate(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """Look up each animal in its own turn, then answer with both colours."""
        messages = list(self.prompt(task))
        for animal, colour in zip(task["animals"], task["answers"], strict=True):
            call = json.dumps({"name": "lookup", "arguments": {"animal": animal}})
            messages += [
                {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "tool", "name": "lookup", "content": colour},
            ]
        return [*messages, {"role": "assistant", "content": " ".join(task["answers"])}]

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, table_size: int = 6) -> list[dict[str, Any]]:
        return generate_lookup_tasks(num, seed, table_size)


class LookupToolsTRL:
    """TRL's side: an `environment_factory` class (`reset` gets the dataset row's columns; its
    public methods are the tools). The same `lookup` signature and docstring, so TRL renders the
    same tool schema (so the same prompt tokens), and the same `lookup_colour` and latency draw. Every instance adds its calls
    and waited seconds to the class-wide `ledger`, which the bench reads at each step's end."""

    latency_s = LATENCY_MEDIAN_S
    sigma = LATENCY_SIGMA
    latency_seed = 0
    ledger: ClassVar[dict[str, float]] = {"tool_calls": 0, "tool_seconds": 0.0}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.task: dict[str, Any] = {}
        self._calls = 0

    def reset(self, **row: Any) -> None:
        self.task = row
        self._calls = 0
        return None

    async def lookup(self, animal: str):  # no return hint: TRL would add it to the schema, agentrl does not
        """Look up an animal's colour in today's table.

        Args:
            animal: The animal's name, e.g. "tiger".
        """
        delay = tool_latency(self.latency_seed, self.task["id"], self._calls, self.latency_s, self.sigma)
        self._calls += 1
        with self._lock:
            self.ledger["tool_calls"] += 1
            self.ledger["tool_seconds"] += delay
        return await lookup_colour(json.loads(self.task["table"]), animal, delay)
