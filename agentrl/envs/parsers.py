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
    """`<tool_call>` JSON blocks as the Qwen2.5 chat template asks for them."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def __init__(self, max_calls: int = 8, max_call_chars: int = 65536) -> None:
        self.max_calls = max_calls
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> ParseResult:
        result = ParseResult()
        blocks = list(self._BLOCK.finditer(text))
        tail = text[blocks[-1].end() :] if blocks else text
        result.content = self._BLOCK.sub("", text).replace("<tool_call>", "").strip()
        if "<tool_call>" in tail:
            result.errors.append("unterminated <tool_call> block: close each call with </tool_call>")
        for i, block in enumerate(blocks):
            if i >= self.max_calls:
                result.errors.append(f"too many tool calls in one turn: at most {self.max_calls} are run")
                break
            call, error = self._parse_block(block.group(1))
            if error:
                result.errors.append(f"tool call {i + 1}: {error}")
            else:
                result.calls.append(call)
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
        alternatives = "|".join(map(re.escape, tags))
        self._action = re.compile(rf"<({alternatives})>(.*?)</\1>", re.S)

    def parse(self, text: str) -> ParseResult:
        result = ParseResult()
        match = self._action.search(text)
        if match is None:
            result.content = text.strip()
            return result
        inner = match.group(2).strip()
        result.content = text[: match.start()].strip()
        if len(inner) > self.max_chars:
            result.errors.append(f"<{match.group(1)}> content exceeds {self.max_chars} characters")
        else:
            result.calls.append(ToolCall(match.group(1), {"text": inner}))
        return result


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "tags": TagParser}


def create_parser(name: str, **kwargs: Any) -> ToolCallParser:
    """A parser by its config name (`env.tool_parser`)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {', '.join(PARSERS)}")
    return PARSERS[name](**kwargs)
