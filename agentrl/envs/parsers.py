"""Tool-call parsing from the model's text. Pluggable; hostile input never raises.

- `HermesParser`: Qwen2.5 / Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, several per turn.
- `TagParser`: plain tags such as Search-R1's `<search> q </search>` / `<answer> a </answer>`.

A parser returns every well-formed call and, separately, a message for every
malformed one (broken JSON, missing name, arguments that are not an object, an
unterminated block, too many calls). The env turns those messages into error
observations; the roller counts them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""  # the text outside any call
    dropped: int = 0  # calls beyond the per-turn limit, not run; reported by the last of `errors`

    @property
    def attempted(self) -> bool:
        """True if the model tried to call anything, well-formed or not."""
        return bool(self.calls or self.errors)


class ToolCallParser:
    """Base class: `parse(text) -> ParseResult`."""

    name = "base"

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>` JSON blocks as the Qwen2.5 chat template asks for them.

    Blocks are found by a linear scan (each block ends at the first `</tool_call>` after its
    opening tag, as a lazy regex would match): a regex `<tool_call>(.*?)</tool_call>` rescans the
    rest of the text from every unclosed opening tag, which took minutes on a completion of many
    unclosed tags. At most `max_calls` blocks are parsed; the rest are counted in `dropped` and
    reported to the model in one error saying which were not run."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int = 8, max_call_chars: int = 65536) -> None:
        self.max_calls = max_calls
        self.max_call_chars = max_call_chars

    def blocks(self, text: str) -> tuple[list[tuple[int, int]], bool]:
        """([(body_start, body_end), ...], unterminated) in one pass over `text`."""
        spans: list[tuple[int, int]] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            body = start + len(self.OPEN)
            end = text.find(self.CLOSE, body)
            if end < 0:
                return spans, True
            spans.append((body, end))
            pos = end + len(self.CLOSE)
        return spans, False

    def parse(self, text: str) -> ParseResult:
        result = ParseResult()
        spans, unterminated = self.blocks(text)
        outside, pos = [], 0
        for body, end in spans:
            outside.append(text[pos : body - len(self.OPEN)])
            pos = end + len(self.CLOSE)
        outside.append(text[pos:])
        result.content = "".join(outside).replace(self.OPEN, "").strip()
        if unterminated:
            result.errors.append("unterminated <tool_call> block: close each call with </tool_call>")
        for i, (body, end) in enumerate(spans[: self.max_calls]):
            call, error = self._parse_block(text[body:end])
            if error:
                result.errors.append(f"tool call {i + 1}: {error}")
            else:
                result.calls.append(call)
        result.dropped = max(0, len(spans) - self.max_calls)
        if result.dropped:
            result.errors.append(
                f"too many tool calls in one turn: calls {self.max_calls + 1} to {len(spans)} "
                f"({result.dropped} calls) were not run; at most {self.max_calls} run per turn, "
                "make the others in your next turn"
            )
        return result

    def _parse_block(self, body: str) -> tuple[ToolCall | None, str | None]:
        body = body.strip()
        if len(body) > self.max_call_chars:
            return None, f"call of {len(body)} characters exceeds {self.max_call_chars}"
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as exc:
            return None, f'invalid JSON ({str(exc)[:120]}); write {{"name": ..., "arguments": {{...}}}}'
        if not isinstance(obj, dict):
            return None, f"expected a JSON object with name and arguments, got {type(obj).__name__}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None, 'missing "name" (a string)'
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode the arguments
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                return None, f'"arguments" of {name} is a string that is not a JSON object'
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None, f'"arguments" of {name} must be a JSON object, got {type(arguments).__name__}'
        return ToolCall(name, arguments), None


class TagParser(ToolCallParser):
    """`<tag> text </tag>` actions; the first complete action of a known tag wins.

    Each action becomes `ToolCall(tag, {"text": inner})`. Generation is usually stopped at
    the first closing tag, so one action per turn is the norm (Search-R1)."""

    name = "tags"

    def __init__(self, tags: tuple[str, ...] = ("search", "answer"), max_chars: int = 65536) -> None:
        if not tags or not all(re.fullmatch(r"[A-Za-z_][\w-]*", t) for t in tags):
            raise ValueError(f"tag names must be identifiers, got {tags!r}")
        self.tags = tags
        self.max_chars = max_chars

    def parse(self, text: str) -> ParseResult:
        result = ParseResult()
        # the earliest opening tag that has a closing tag after it wins (what the lazy regex
        # `<(a|b)>(.*?)</\1>` matches), found with two `find`s per tag instead of a regex that
        # rescans the text from every unclosed tag
        found: tuple[int, int, int, str] | None = None
        for tag in self.tags:
            start = text.find(f"<{tag}>")
            if start < 0 or (found is not None and start > found[0]):
                continue
            end = text.find(f"</{tag}>", start + len(tag) + 2)
            if end >= 0:
                found = (start, start + len(tag) + 2, end, tag)
        if found is None:
            result.content = text.strip()
            return result
        start, body, end, tag = found
        inner = text[body:end].strip()
        result.content = text[:start].strip()
        if len(inner) > self.max_chars:
            result.errors.append(f"<{tag}> content exceeds {self.max_chars} characters")
        else:
            result.calls.append(ToolCall(tag, {"text": inner}))
        return result


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "tags": TagParser}


def create_parser(name: str, **kwargs: Any) -> ToolCallParser:
    """A parser by its config name (`env.tool_parser`)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {', '.join(PARSERS)}")
    return PARSERS[name](**kwargs)
