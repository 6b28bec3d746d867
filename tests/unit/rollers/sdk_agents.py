"""Agent programs written only against the `openai` SDK, as users write them, for the endpoint's tests.

Each is `async def agent(base_url, api_key, task)`; the task's fields choose what it does."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
from openai import AsyncOpenAI, BadRequestError

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The colour of an animal.",
        "parameters": {"type": "object", "properties": {"animal": {"type": "string"}}, "required": ["animal"]},
    }},
]  # fmt: skip
TABLE = {"cat": "red", "dog": "blue"}
RESULTS: dict[str, Any] = {}
"""What each in-process agent returned or saw, by task id (the tests read it)."""


async def _complete(client: AsyncOpenAI, messages: list[dict], stream: bool) -> dict[str, Any]:
    """One assistant message as a dict (the streamed chunks put together, as agents do)."""
    if not stream:
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        return {**choice.message.model_dump(exclude_none=True), "finish_reason": choice.finish_reason}
    content, calls, finish = "", {}, None
    chunks = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})  # fmt: skip
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None, "finish_reason": finish}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


_shared: AsyncOpenAI | None = None


def _client(base_url: str, api_key: str, task: dict[str, Any]) -> AsyncOpenAI:
    """A client of its own, or (`task["shared_client"]`) a copy of one shared client with this
    episode's URL and key: building a client costs ~80 ms of CPU, copying one reuses its connections."""
    global _shared
    if not task.get("shared_client"):
        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if _shared is None:
        _shared = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _shared.with_options(base_url=base_url, api_key=api_key)


async def tool_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, Any]:
    """Multi-turn: runs every tool call the model makes (in parallel), until it answers."""
    client = _client(base_url, api_key, task)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the lookup tool."},
                                      {"role": "user", "content": task["question"]}]  # fmt: skip
    finishes = []
    try:
        for _ in range(task.get("max_turns", 4)):
            message = await _complete(client, messages, task.get("stream", False))
            finishes.append(message.pop("finish_reason"))
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                animal = json.loads(call["function"]["arguments"]).get("animal", "")
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": TABLE.get(animal, "?")}
                )
    finally:
        if not task.get("shared_client"):
            await client.close()
    result = RESULTS[task["id"]] = {"answer": messages[-1].get("content"), "finishes": finishes}
    return result


async def stripping_agent(base_url: str, api_key: str, task: dict[str, Any]) -> list[str]:
    """Chats three turns, but sends its earlier assistant messages back with whitespace stripped."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    answers = []
    async with client:
        for turn in range(3):
            response = await client.chat.completions.create(model="policy", messages=messages)
            text = response.choices[0].message.content or ""
            answers.append(text)
            messages += [{"role": "assistant", "content": text.strip() if task["strip"] else text},
                         {"role": "user", "content": f"and again ({turn})"}]  # fmt: skip
    return answers


async def rude_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, Any]:
    """Sends malformed requests and requests under another episode's key, then a good one."""
    seen: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url) as http:
        auth = {"Authorization": f"Bearer {api_key}"}
        for name, body in {
            "not_json": b"{nope",
            "no_messages": json.dumps({"model": "policy"}).encode(),
            "bad_role": json.dumps({"model": "policy", "messages": [{"role": "robot", "content": "x"}]}).encode(),
            "bad_max_tokens": json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(),
            "n2": json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(),
        }.items():  # fmt: skip
            response = await http.post("/chat/completions", content=body, headers=auth)
            seen[name] = (response.status_code, response.json())
        for name, headers in {
            "other_key": {"Authorization": f"Bearer {task['other_key']}"},
            "no_key": {},
        }.items():
            response = await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                                       headers=headers)  # fmt: skip
            seen[name] = (response.status_code, response.json())
        seen["models"] = (await http.get("/models", headers=auth)).json()
        seen["reward"] = (await http.post("/agentrl/reward", json={"reward": 0.75}, headers=auth)).status_code
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        try:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": 3}])
        except BadRequestError as exc:
            seen["sdk_error"] = (exc.status_code, exc.body)
        response = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        seen["good"] = response.choices[0].finish_reason
    RESULTS[task["id"]] = seen
    return seen


async def hanging_agent(base_url: str, api_key: str, task: dict[str, Any]) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        await asyncio.sleep(3600)


async def crashing_agent(base_url: str, api_key: str, task: dict[str, Any]) -> None:
    raise RuntimeError("the agent's own bug")


async def looping_agent(base_url: str, api_key: str, task: dict[str, Any]) -> None:
    """Asks again and again, ignoring every error: the endpoint's request limit must end it."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        while True:
            with contextlib.suppress(BadRequestError):
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}]
                )


async def continuing_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, Any]:
    """Has the model go on writing its own turn after text the agent added (`continue_final_message`),
    first in three ways the endpoint refuses."""
    seen: dict[str, Any] = {}
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        user = {"role": "user", "content": "hi"}
        first = await client.chat.completions.create(model="policy", messages=[user], stop=["<stop>"])
        text = first.choices[0].message.content or ""
        for name, content, extra in (
            ("without_stop", text + " more", go_on),  # the stop sequence the model wrote is left out
            ("edited", "Ho <stop> more", go_on),
            ("with_generation_prompt", text + "<stop> more", {**go_on, "add_generation_prompt": True}),
            ("continued", text + "<stop> more", go_on),
        ):
            try:
                response = await client.chat.completions.create(
                    model="policy", messages=[user, {"role": "assistant", "content": content}],
                    stop=["<stop>"], extra_body=extra,
                )  # fmt: skip
                seen[name] = response.choices[0].finish_reason
            except BadRequestError as exc:
                seen[name] = (exc.status_code, exc.body)
    RESULTS[task["id"]] = seen
    return seen


def reward(transcript: Any, result: Any) -> float:
    """1 if the agent's answer names the colour of the task's animal."""
    answer = (result or {}).get("answer") or ""
    return float(TABLE[transcript.task["animal"]] in answer)


if __name__ == "__main__":  # the agent as a subprocess: the endpoint and key from the environment
    import os
    import sys

    task = json.loads(sys.stdin.read())
    assert task == json.loads(os.environ["AGENTRL_TASK"])
    result = asyncio.run(tool_agent(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], task))
    print("some log line")
    print(json.dumps(result))


async def sampling_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, Any]:
    """Asks for its own temperature, then overruns the context; records what it was answered."""
    seen: dict[str, Any] = {}
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        try:
            response = await client.chat.completions.create(
                model="policy", messages=messages, temperature=0.3
            )
            seen["temperature"] = response.choices[0].finish_reason
            messages += [{"role": "assistant", "content": response.choices[0].message.content},
                         {"role": "user", "content": "word " * 400}]  # fmt: skip
            await client.chat.completions.create(model="policy", messages=messages)
        except BadRequestError as exc:
            seen["error"] = (exc.status_code, exc.body)
    RESULTS[task["id"]] = seen
    return seen
