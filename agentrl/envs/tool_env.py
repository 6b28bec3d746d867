"""`ToolEnv`: an environment whose actions are tool calls to plain Python functions.

    class Calculator(ToolEnv):
        system_prompt = "Use the calculator, then give the final number."

        @tool
        def calculator(self, expression: str) -> str:
            '''Evaluate an arithmetic expression.

            Args:
                expression: e.g. "12 * 7".
            '''
            return str(safe_eval(expression))

        def reward(self, transcript):
            return float(transcript.final_text.strip() == self.task["answer"])

Each assistant turn is parsed for tool calls (Hermes/Qwen `<tool_call>` JSON by
default). Calls run concurrently, each under a timeout, and their results come back
as `tool` messages. A turn with no call attempt ends the episode (its text is the
final answer). Malformed calls, unknown tools, bad arguments, exceptions, timeouts
and results that cannot be shown become error observations and are counted in `metrics`;
oversized results are cut with a marker (`tool_truncated`). Calls beyond the parser's per-turn
limit are not run: the model is told which (one error observation) and they are counted in
`tool_calls_dropped`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from typing import Any

from agentrl.envs.base import Env, Messages, StepResult
from agentrl.envs.parsers import ToolCall, ToolCallParser, create_parser
from agentrl.envs.tools import Tool, ToolOutput, as_tool

PARSE_OFF_LOOP_CHARS = 1 << 15
"""Turns longer than this are parsed in a worker thread, so one huge completion cannot hold
the roller's event loop (which runs every other episode) while it is scanned."""


class ToolEnv(Env):
    """A multi-turn tool-calling environment; subclass it or pass `tools=[...]`."""

    system_prompt: str | None = None
    """System message put before the task's prompt (None: the chat template's default)."""
    required_task_fields = (("messages", "prompt", "question"),)  # what `prompt` reads

    def __init__(
        self,
        tools: list[Any] | None = None,
        parser: str | ToolCallParser = "hermes",
        tool_timeout_s: float = 30.0,
        max_tool_output_chars: int = 4096,
    ) -> None:
        super().__init__()
        declared = [
            getattr(self, name)
            for name, member in inspect.getmembers(type(self))
            if hasattr(member, "__agentrl_tool__")
        ]
        self.tools: list[Tool] = [as_tool(t) for t in [*declared, *(tools or [])]]
        names = [t.name for t in self.tools]
        duplicates = sorted(n for n, c in Counter(names).items() if c > 1)
        if duplicates:
            raise ValueError(f"{type(self).__name__}: duplicate tool names {duplicates}")
        self._by_name = {t.name: t for t in self.tools}
        self.parser = create_parser(parser) if isinstance(parser, str) else parser
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_output_chars = max_tool_output_chars
        self.task: dict[str, Any] = {}
        self.metrics = {"tool_calls": 0, "tool_errors": 0}

    def prompt(self, task: dict[str, Any]) -> Messages:
        """The opening messages for a task: system prompt plus the task's question."""
        if "messages" in task:
            return list(task["messages"])
        text = task.get("prompt", task.get("question"))
        if not isinstance(text, str):
            raise ValueError(
                "a task needs 'messages', 'prompt' or 'question' (override ToolEnv.prompt otherwise)"
            )
        messages: Messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*messages, {"role": "user", "content": text}]

    def reset(self, task: dict[str, Any]) -> Messages:
        self.task = task
        return self.prompt(task)

    async def step(self, action_text: str) -> StepResult:
        if len(action_text) > PARSE_OFF_LOOP_CHARS:
            parsed = await asyncio.to_thread(self.parser.parse, action_text)
        else:
            parsed = self.parser.parse(action_text)
        if not parsed.attempted:
            return StepResult(None, 0.0, True, {"final": parsed.content})
        outputs = await asyncio.gather(*(self._run(call) for call in parsed.calls))
        messages: Messages = []
        for call, out in zip(parsed.calls, outputs, strict=True):
            messages.append({"role": "tool", "name": call.name, "content": out.text})
            self._count(out)
        for i, error in enumerate(parsed.errors):
            messages.append({"role": "tool", "content": f"Error: {error}"})
            # a parser reports calls beyond its limit in its last error
            dropped = parsed.dropped and i == len(parsed.errors) - 1
            self._count(ToolOutput("", error="too_many_calls" if dropped else "malformed"))
        if parsed.dropped:
            self.metrics["tool_calls_dropped"] = self.metrics.get("tool_calls_dropped", 0) + parsed.dropped
        return StepResult(messages, 0.0, False, {"calls": [c.name for c in parsed.calls]})

    async def _run(self, call: ToolCall) -> ToolOutput:
        found = self._by_name.get(call.name)
        if found is None:
            known = ", ".join(self._by_name) or "none"
            return ToolOutput(
                f"Error: unknown tool {call.name!r}; available tools: {known}", error="unknown_tool"
            )
        return await found.call(call.arguments, self.tool_timeout_s, self.max_tool_output_chars)

    def _count(self, out: ToolOutput) -> None:
        self.metrics["tool_calls"] += 1
        if out.error:
            self.metrics["tool_errors"] += 1
            key = f"tool_error_{out.error}"
            self.metrics[key] = self.metrics.get(key, 0) + 1
        if out.truncated:
            self.metrics["tool_truncated"] = self.metrics.get("tool_truncated", 0) + 1
