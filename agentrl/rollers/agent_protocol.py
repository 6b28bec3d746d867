"""What the agent endpoint speaks: OpenAI's chat-completions request, checked, and its answers.

    chat = parse_request(body)        # a ChatRequest, or EndpointError(400, ...) naming the param
    body = completion_body(turn, model, cid, created)
    chunks = completion_chunks(turn, model, cid, created, include_usage)

Shapes as the `openai` Python SDK 3.x sends and parses them. A request's messages come out in
the chat template's form: roles mapped (`developer` is `system`), content as text (a string or
text parts), an assistant message's tool calls with their arguments parsed into objects, so
that two requests holding the same conversation compare equal whatever the agent's JSON
spacing. vLLM's `continue_final_message` (with `add_generation_prompt: false`, sent through
the SDK's `extra_body`) asks the model to go on writing the last, assistant, message. The server (`agent_endpoint.py`) and the episode (`agent_episode.py`) both build on
this module; it imports neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class EndpointError(Exception):
    """An OpenAI-style error answer: HTTP `status` and `{"error": {message, type, param, code}}`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Turn:
    """What one request produced: the text, the parsed calls, and how the turn ended."""

    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class ChatRequest:
    """A validated chat-completions request; `messages` in the chat template's form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    continue_final: bool = False
    """vLLM's `continue_final_message`: the model goes on writing the last (assistant) message."""


def _text(content: Any, param: str) -> str:
    """Message content as text: a string, None (empty) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise EndpointError(400, "only text content parts are supported", param=f"{param}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise EndpointError(400, f"content must be a string or a list of text parts, got {type(content).__name__}",
                        param=param)  # fmt: skip


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls in the template's form (arguments as objects)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise EndpointError(400, "tool_calls must be a list", param=param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointError(400, "a tool call needs function.name", param=f"{param}[{j}]")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise EndpointError(400, "function.arguments is not JSON",
                                    param=f"{param}[{j}].function.arguments") from None  # fmt: skip
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise EndpointError(400, "each message must be an object", param=param)
    role = ROLES.get(m.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise EndpointError(400, f"unknown role {m.get('role')!r}: use one of {', '.join(ROLES)}",
                            param=f"{param}.role")  # fmt: skip
    if role != "assistant" and m.get("content") is None:
        raise EndpointError(400, f"a {role} message needs content", param=f"{param}.content")
    message: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{param}.content")}
    if role == "assistant":
        calls = _tool_calls(m.get("tool_calls"), f"{param}.tool_calls")
        if calls:
            message["tool_calls"] = calls
    return message


def parse_request(body: Any) -> ChatRequest:
    """A `ChatRequest`, or the `EndpointError` that says what is wrong."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "messages must be a non-empty list", param="messages")
    if body.get("n", 1) not in (1, None):
        raise EndpointError(400, "n must be 1: one completion per request", param="n")
    continue_final = bool(body.get("continue_final_message"))
    if continue_final and body.get("add_generation_prompt"):
        raise EndpointError(400, "continue_final_message goes with add_generation_prompt false: the model "
                            "continues the last message instead of starting a new turn",
                            param="add_generation_prompt")  # fmt: skip
    options = body.get("stream_options")
    return ChatRequest(
        [_message(m, i) for i, m in enumerate(messages)],
        tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        max_tokens=_max_tokens(body.get("max_completion_tokens", body.get("max_tokens"))),
        stop=_stop(body.get("stop")),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        model=str(body.get("model", "")),
        continue_final=continue_final,
    )


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools
    ):  # fmt: skip
        raise EndpointError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}',
                            param="tools")  # fmt: skip
    return tools or None


def _max_tokens(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 1):
        raise EndpointError(400, f"max_tokens must be a positive integer, got {value!r}", param="max_tokens")
    return value


def _stop(stop: Any) -> list[str]:
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise EndpointError(400, "stop must be a string or a list of strings", param="stop")
    return [s for s in stop or [] if s]


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise EndpointError(400, f"{name} must be a number", param=name)
    return value


def _usage(turn: Turn) -> dict[str, int]:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}  # fmt: skip


def completion_body(turn: Turn, model: str, cid: str, created: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": None}],
        "usage": _usage(turn),
    }  # fmt: skip


def completion_chunks(turn: Turn, model: str, cid: str, created: int, include_usage: bool) -> list[dict]:
    """The streamed form of a turn: role, content, one delta per tool call, finish, usage."""
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if turn.content:
        chunks.append(chunk({"content": turn.content}))
    for i, call in enumerate(turn.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, turn.finish_reason))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(turn)})
    return chunks
