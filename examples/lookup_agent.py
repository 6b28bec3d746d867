"""The quickstart's lookup task solved by an agent written only with the `openai` SDK.

    agentrl init-model mini runs/models/mini
    agentrl run --config recipes/quickstart_agent.yaml

`solve` is an ordinary agent: it asks the model, reads `<lookup> animal </lookup>` from the
reply, writes the colour from the task's table after it and lets the model go on in the same
turn, and returns the model's `<answer>`. agentrl runs it once per episode against the roller's
OpenAI-compatible endpoint (`env.name: agent`) and trains on the tokens the endpoint recorded:
the same tokens the built-in lookup env's episodes hold, so the recipe learns as the quickstart
does. `LookupAgent` is that agent env with its kwargs filled in, the built-in env's task
generator and its weak teacher's demonstrations, so `agentrl run`'s warm start can draw tasks
and demonstrations from the class alone.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from openai import AsyncOpenAI

from agentrl.envs.agent import AgentEnv
from agentrl.envs.toy import LookupEnv

_clients: dict[asyncio.AbstractEventLoop, AsyncOpenAI] = {}
STOP = ["</lookup>", "</answer>"]


def client(base_url: str, api_key: str) -> AsyncOpenAI:
    """One SDK client per event loop, copied per episode with that episode's URL and key (building a
    client costs tens of milliseconds; a copy shares the connection pool, which belongs to its loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _clients[loop].with_options(base_url=base_url, api_key=api_key)


async def solve(base_url: str, api_key: str, task: dict[str, Any]) -> str | None:
    """Look the animal up, then let the model answer; the answer's text, or None.

    The result is written into the model's own turn, after its `</lookup>`, and the model is asked to
    go on from there (`continue_final_message`, vLLM's chat-completions extension): the episode is
    then token for token the built-in lookup env's, which appends the result the same way."""
    llm = client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    reply = await llm.chat.completions.create(model="policy", messages=messages, stop=STOP)
    text = reply.choices[0].message.content or ""
    for _ in range(2):
        answer = re.search(r"<answer>(.*)", text, re.S)
        if answer:
            return answer.group(1).strip()
        lookup = re.search(r"<lookup>(.*)", text, re.S)
        if lookup is None or reply.choices[0].finish_reason != "stop":
            return None  # no lookup, or a turn cut at max_tokens: no stop sequence to continue after
        found = task["table"].get(lookup.group(1).strip(), "unknown")
        turn = f"{text}</lookup> <result> {found} </result>"
        reply = await llm.chat.completions.create(
            model="policy",
            messages=[*messages, {"role": "assistant", "content": turn}],
            stop=STOP,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        text = reply.choices[0].message.content or ""
    return None


def reward(transcript: Any, result: Any) -> float:
    return float(result == transcript.task["answer"])


class LookupAgent(AgentEnv):
    """`env.name: examples.lookup_agent:LookupAgent`: `solve` on the built-in lookup tasks."""

    tasks_from = "toy_lookup"

    def __init__(self, **kwargs: Any) -> None:
        self.teacher_error_rate = kwargs.pop("teacher_error_rate", 0.3)
        defaults = {"agent": f"{__name__}:solve", "reward": f"{__name__}:reward"}
        super().__init__(**{**defaults, **kwargs})

    def demonstrate(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The built-in lookup env's demonstrations (a weak teacher that misreads `teacher_error_rate`
        of the results): `solve`'s episodes have the same layout, token for token."""
        return LookupEnv(teacher_error_rate=self.teacher_error_rate).demonstrate(task)
