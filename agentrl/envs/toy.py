"""Toy multi-turn tool envs: a key-value lookup (the quickstart's) and a calculator.

`LookupEnv` (`toy_lookup`): each task hides a fresh random table of animal → colour; the
question asks for one animal's colour, which only a `<lookup>` action can tell. The model
must look up the animal named in the question, read the `<result>` and answer with the
colour: two copies of one word each (every word is a single token of the tiny model's
tokenizer, and the prompt is short), which a tiny model learns on CPU within minutes.

`CalculatorEnv` (`toy_calculator`): multi-turn arithmetic with a calculator tool. The `_slow`
variants of both (`toy_lookup_slow`, `toy_calculator_slow`) add a long-tailed tool latency.

A calculator task asks for the value of an expression too big for a tiny model to compute in its
head (`What is 347 * 29 + 18?`). The model is meant to call the `calculator` tool,
read the `<tool_response>`, and answer with the number alone. Reward 1 if the final
answer is the right number, else 0 (plus an optional small bonus for a well-formed
tool call, to help a cold-start model). Tasks are generated, so the env needs no data.

    agentrl run --config recipes/quickstart.yaml   # uses env.name: toy_lookup
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import random
import re
from typing import Any

from agentrl.envs.base import Env, StepResult, Transcript
from agentrl.envs.parsers import TagParser
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_ABS = 10**18


def safe_eval(expression: str) -> int:
    """Integer arithmetic (+ - * // % and parentheses) without eval: the model's input is hostile."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    tree = ast.parse(expression.replace("×", "*").replace("÷", "//"), mode="eval")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ZeroDivisionError("division by zero")
            result = _OPS[type(node.op)](left, right)
            if abs(result) > _MAX_ABS:
                raise ValueError("result too large")
            return result
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    return ev(tree.body)


_NUMBER = re.compile(r"-?\d+")


class CalculatorEnv(ToolEnv):
    """Answer arithmetic questions, using the calculator tool."""

    system_prompt = "You are a calculator agent. Use the calculator tool, then answer with the number only."
    required_task_fields = (("messages", "prompt", "question"), "answer")

    def __init__(self, format_bonus: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.format_bonus = format_bonus

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression.

        Args:
            expression: The expression, e.g. "347 * 29 + 18".
        """
        return str(safe_eval(expression))

    def reward(self, transcript: Transcript) -> float:
        numbers = _NUMBER.findall(transcript.final_text)
        correct = bool(numbers) and numbers[-1] == str(self.task["answer"])
        used_tool = self.metrics["tool_calls"] > self.metrics["tool_errors"]
        return float(correct) + (self.format_bonus if used_tool else 0.0)

    def demonstrate(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """Call the calculator on the question's expression, then answer with its result."""
        call = json.dumps({"name": "calculator", "arguments": {"expression": task["expression"]}})
        return [
            *self.prompt(task),
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": "calculator", "content": str(safe_eval(task["expression"]))},
            {"role": "assistant", "content": str(task["answer"])},
        ]

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, digits: int = 3, terms: int = 2) -> list[dict[str, Any]]:
        """`num` questions like "What is 347 * 29 + 18?" with their answers, reproducible by seed."""
        rng = random.Random(seed)
        tasks = []
        for i in range(num):
            parts = [str(rng.randint(10 ** (digits - 1), 10**digits - 1))]
            for _ in range(terms - 1):
                parts += [rng.choice(["+", "-", "*"]), str(rng.randint(2, 10 ** (digits - 1)))]
            expression = " ".join(parts)
            tasks.append(
                {
                    "id": f"calc-{seed}-{i}",
                    "question": f"What is {expression}?",
                    "expression": expression,
                    "answer": str(safe_eval(expression)),
                }
            )
        return tasks


class ParetoLatency:
    """A long-tailed tool latency, like sandboxes and search engines have: each `sleep()` waits
    `latency_s × Pareto(alpha)` scaled so the median is latency_s (a heavy tail of slow calls),
    capped at `max_latency_s`."""

    def __init__(self, latency_s: float = 0.2, alpha: float = 1.5, max_latency_s: float = 10.0) -> None:
        self.latency_s, self.alpha, self.max_latency_s = latency_s, alpha, max_latency_s
        self._rng = random.Random()

    async def sleep(self) -> None:
        delay = self.latency_s * self._rng.paretovariate(self.alpha) / 2 ** (1 / self.alpha)
        await asyncio.sleep(min(self.max_latency_s, delay))


class _SlowTools:
    """Mixin of the `_slow` envs: `self.latency`, a `ParetoLatency` built from the constructor's
    `latency_s`, `alpha` and `max_latency_s`; every other keyword goes to the env itself."""

    def __init__(
        self, latency_s: float = 0.2, alpha: float = 1.5, max_latency_s: float = 10.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.latency = ParetoLatency(latency_s, alpha, max_latency_s)


class SlowCalculatorEnv(_SlowTools, CalculatorEnv):
    """The calculator whose tool calls take a `ParetoLatency`. Used by `agentrl bench async` to
    show what bounded staleness buys."""

    @tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression.

        Args:
            expression: The expression, e.g. "347 * 29 + 18".
        """
        await self.latency.sleep()
        return str(safe_eval(expression))


LOOKUP_KEYS = (
    "tiger", "horse", "camel", "otter", "eagle", "shark", "zebra", "koala", "llama", "panda", "whale", "moose",
    "snake", "goose", "raven", "bison", "hyena", "lemur", "sloth", "gecko", "heron", "finch", "trout", "viper",
)  # fmt: skip
LOOKUP_VALUES = (
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "orange",
    "purple",
    "pink",
    "brown",
    "grey",
    "gold",
)


class LookupEnv(Env):
    """Find an animal's colour in a hidden per-task table with a `<lookup>` action.

    A tag protocol, like Search-R1's: the model writes `<lookup> tiger </lookup>`, the env
    appends ` <result> red </result>` to the same turn (loss mask 0), and the model ends
    with `<answer> red </answer>`. No tool schema is rendered into the prompt, so the
    context stays short and a tiny model learns the two one-token copies in minutes."""

    stop = ("</lookup>", "</answer>")
    required_task_fields = ("question", "table", "answer")

    def __init__(self, max_lookups: int = 2, teacher_error_rate: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= teacher_error_rate < 1.0:
            raise ValueError(f"teacher_error_rate must be in [0, 1), got {teacher_error_rate}")
        self.max_lookups = max_lookups
        self.teacher_error_rate = teacher_error_rate
        self.parser = TagParser(("lookup", "answer"))
        self.task: dict[str, Any] = {}
        self.answer: str | None = None
        self.metrics = {"tool_calls": 0, "tool_errors": 0}

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        return [{"role": "user", "content": task["question"]}]

    def step(self, action_text: str) -> StepResult:
        parsed = self.parser.parse(action_text)
        call = parsed.calls[0] if parsed.calls else None
        if call is not None and call.name == "answer":
            self.answer = call.arguments["text"]
            return StepResult(None, 0.0, True, {})
        self.metrics["tool_calls"] += 1
        if call is None or self.metrics["tool_calls"] > self.max_lookups:
            self.metrics["tool_errors"] += 1
            return StepResult(" <result> write <lookup> animal </lookup> or <answer> colour </answer> </result>",
                              0.0, False, {})  # fmt: skip
        value = self.task["table"].get(call.arguments["text"])
        if value is None:
            self.metrics["tool_errors"] += 1
            value = "unknown"
        return StepResult(f" <result> {value} </result>", 0.0, False, {})

    def reward(self, transcript: Transcript) -> float:
        return float(self.answer is not None and self.answer.strip() == self.task["answer"])

    def demonstrate(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """Look the animal up, then answer with the result (tag-protocol segments).

        With `teacher_error_rate` > 0 the demonstrator is a weak teacher: on that share of
        tasks (fixed per task id) it misreads the result and answers another colour. Imitation
        caps a model near the teacher's accuracy; RL, rewarded for the right colour, has to go
        past it — the quickstart's story."""
        rng = random.Random(task["id"])
        answer = task["answer"]
        if rng.random() < self.teacher_error_rate:
            answer = rng.choice([c for c in LOOKUP_VALUES if c != answer])
        return [
            *self.reset(task),
            {"role": "assistant", "content": f"<lookup> {task['animal']} </lookup>", "end": "stop"},
            {"role": "observation", "content": f" <result> {task['answer']} </result>"},
            {"role": "assistant", "content": f" <answer> {answer} </answer>", "end": "stop"},
        ]

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, table_size: int = 8) -> list[dict[str, Any]]:
        """`num` questions, each with its own random table of `table_size` animals."""
        rng = random.Random(seed)
        tasks = []
        for i in range(num):
            animals = rng.sample(LOOKUP_KEYS, table_size)
            table = {a: rng.choice(LOOKUP_VALUES) for a in animals}
            animal = rng.choice(animals)
            tasks.append(
                {
                    "id": f"lookup-{seed}-{i}",
                    "question": f"What colour is the {animal} today?",
                    "animal": animal,
                    "table": table,
                    "answer": table[animal],
                }
            )
        return tasks


class SlowLookupEnv(_SlowTools, LookupEnv):
    """The lookup env whose lookups take a `ParetoLatency`. `agentrl bench async` runs it with
    the quickstart's model, so each k's samples/s and final reward are both measured."""

    async def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if not result.done:  # a lookup (or a malformed action): the tool takes its time
            await self.latency.sleep()
        return result
