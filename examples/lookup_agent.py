"""The quickstart's lookup task solved by an agent written only with the `openai` SDK.

    agentrl init-model mini runs/models/mini
    agentrl run --config recipes/quickstart_agent.yaml

`solve` is an ordinary agent: it asks the model, reads `<lookup> animal </lookup>` from the
reply, answers with the colour from the task's table as the next user turn, and returns the
model's `<answer>`. agentrl runs it once per episode against the roller's OpenAI-compatible
endpoint (`env.name: agent`) and trains on the tokens the endpoint recorded. `LookupAgent` is
that agent env with its kwargs filled in and the built-in lookup env's task generator, so
`agentrl run`'s warm start can draw tasks and demonstrations from the class alone.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openai import AsyncOpenAI

from agentrl.envs.agent import AgentEnv
from agentrl.envs.toy import LOOKUP_VALUES

_client: AsyncOpenAI | None = None


def client(base_url: str, api_key: str) -> AsyncOpenAI:
    """One SDK client per process, copied per episode with that episode's URL and key (building a
    client costs tens of milliseconds; a copy shares the connection pool)."""
    global _client
    if _client is None:
        _client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _client.with_options(base_url=base_url, api_key=api_key)


async def solve(base_url: str, api_key: str, task: dict[str, Any]) -> str | None:
    """Look the animal up, then let the model answer; the answer's text, or None."""
    llm = client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    for _ in range(3):
        response = await llm.chat.completions.create(
            model="policy", messages=messages, stop=["</lookup>", "</answer>"]
        )
        text = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = re.search(r"<answer>(.*)", text, re.S)
        if answer:
            return answer.group(1).strip()
        lookup = re.search(r"<lookup>(.*)", text, re.S)
        found = task["table"].get(lookup.group(1).strip(), "unknown") if lookup else None
        result = found or "write <lookup> animal </lookup> or <answer> colour </answer>"
        messages.append({"role": "user", "content": f"<result> {result} </result>"})
    return None


def reward(transcript: Any, result: Any) -> float:
    return float(result == transcript.task["answer"])


def demonstrate(task: dict[str, Any], teacher_error_rate: float = 0.3) -> list[dict[str, Any]]:
    """The conversation `solve` has with an ideal model, except that on `teacher_error_rate` of
    the tasks (fixed per task id) the teacher misreads the result, as the quickstart's does."""
    rng = random.Random(task["id"])
    answer = task["answer"]
    if rng.random() < teacher_error_rate:
        answer = rng.choice([c for c in LOOKUP_VALUES if c != answer])
    return [
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": f"<lookup> {task['animal']} </lookup>", "end": "stop"},
        {"role": "user", "content": f"<result> {task['answer']} </result>"},
        {"role": "assistant", "content": f"<answer> {answer} </answer>", "end": "stop"},
    ]


class LookupAgent(AgentEnv):
    """`env.name: examples.lookup_agent:LookupAgent`: `solve` on the built-in lookup tasks."""

    tasks_from = "toy_lookup"

    def __init__(self, **kwargs: Any) -> None:
        defaults = {"agent": f"{__name__}:solve", "reward": f"{__name__}:reward",
                    "demonstrate": f"{__name__}:demonstrate"}  # fmt: skip
        super().__init__(**{**defaults, **kwargs})
