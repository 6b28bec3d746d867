"""@tool: schemas from type hints and docstrings; every failure becomes an observation."""

from __future__ import annotations

import asyncio
import time
from enum import Enum
from typing import Literal

import pytest

from agentrl.envs.tools import Tool, as_tool, make_tool, parse_docstring, tool, truncate, type_schema


class Unit(Enum):
    C = "celsius"
    F = "fahrenheit"


@tool
def weather(
    city: str,
    days: int = 1,
    unit: Unit = Unit.C,
    detail: Literal["short", "long"] = "short",
    tags: list[str] | None = None,
) -> str:
    """Forecast the weather.

    Args:
        city: City name, e.g. "Paris".
        days: How many days,
            counted from today.
        unit: Temperature unit.
        detail: How much to say.
        tags: Optional labels.
    """
    return f"{city}:{days}:{unit.value}:{detail}:{tags}"


def test_schema_in_openai_function_format() -> None:
    schema = as_tool(weather).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "weather" and fn["description"] == "Forecast the weather."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": 'City name, e.g. "Paris".'}
    assert props["days"] == {"type": "integer", "description": "How many days, counted from today."}
    assert props["unit"] == {
        "enum": ["celsius", "fahrenheit"],
        "type": "string",
        "description": "Temperature unit.",
    }
    assert props["detail"]["enum"] == ["short", "long"]
    assert props["tags"]["type"] == ["array", "null"] and props["tags"]["items"] == {"type": "string"}
    assert fn["parameters"]["required"] == ["city"]


def test_type_schema_edge_cases() -> None:
    assert type_schema(dict[str, int]) == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert type_schema(int | str) == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    with pytest.raises(TypeError, match="cannot describe"):
        type_schema(object)


def test_docstring_parsing_without_args_section() -> None:
    assert parse_docstring("Just a line.") == ("Just a line.", {})
    assert parse_docstring(None) == ("", {})


async def test_arguments_are_validated_and_coerced() -> None:
    t = as_tool(weather)
    out = await t.call({"city": "Oslo", "days": "3", "unit": "fahrenheit"}, 5, 1000)
    assert out.error is None and out.text == "Oslo:3:fahrenheit:short:None"
    missing = await t.call({}, 5, 1000)
    assert missing.error == "bad_arguments" and "city: field required" in missing.text
    extra = await t.call({"city": "x", "bogus": 1}, 5, 1000)
    assert extra.error == "bad_arguments" and "bogus" in extra.text
    wrong = await t.call({"city": "x", "days": "many"}, 5, 1000)
    assert wrong.error == "bad_arguments" and "days" in wrong.text
    bad_enum = await t.call({"city": "x", "detail": "medium"}, 5, 1000)
    assert bad_enum.error == "bad_arguments"


async def test_raising_hanging_and_huge_tools_become_errors() -> None:
    def boom(x: int) -> str:
        raise RuntimeError("kaboom")

    def hang_sync() -> str:
        time.sleep(2)
        return "late"

    async def hang_async() -> str:
        await asyncio.sleep(30)
        return "late"

    def huge() -> str:
        return "x" * 100_000

    out = await make_tool(boom).call({"x": 1}, 5, 1000)
    assert out.error == "raised" and "RuntimeError: kaboom" in out.text
    for fn in (hang_sync, hang_async):
        out = await make_tool(fn).call({}, 0.2, 1000)
        assert out.error == "timeout" and "timed out after 0.2s" in out.text
    out = await make_tool(huge).call({}, 5, 500)
    assert out.truncated and len(out.text) <= 500 and "truncated" in out.text


async def test_async_tools_and_structured_results() -> None:
    async def lookup(key: str) -> dict:
        """Look up a key."""
        return {"key": key, "values": [1, 2]}

    out = await make_tool(lookup).call({"key": "k"}, 5, 1000)
    assert out.text == '{"key": "k", "values": [1, 2]}'


def test_decorator_with_arguments() -> None:
    @tool(name="add_numbers", description="Add.")
    def add(a: int, b: int) -> int:
        return a + b

    t = as_tool(add)
    assert t.name == "add_numbers" and t.description == "Add."
    assert add(1, 2) == 3  # the function itself is unchanged


def test_truncate_marks_what_it_cut() -> None:
    text, cut = truncate("a" * 100, 60)
    kept = text.split("\n")[0]
    assert cut and len(text) <= 60
    assert text.endswith(f"[truncated {100 - len(kept)} characters]") and set(kept) == {"a"}
    assert truncate("short", 60) == ("short", False)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _recursive() -> dict:
    value: dict = {}
    value["self"] = value
    return value


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@pytest.mark.parametrize(
    ("fn", "arguments", "reason"),
    [
        (lambda a, b: a + b, {"a": int("9" * 4300), "b": int("9" * 4300)}, "4300 digits"),
        (lambda: _nested(100_000), {}, "RecursionError"),
        (_recursive, {}, "Circular reference"),
        (lambda: {"x": _Unprintable()}, {}, "no text for you"),
    ],
    ids=["huge_int", "deeply_nested", "recursive", "raising_str"],
)
async def test_results_that_cannot_be_shown_are_error_observations(fn, arguments, reason) -> None:
    out = await Tool("t", "", {}, fn).call(arguments, 5, 4096)
    assert out.error == "bad_result" and "cannot be shown" in out.text and reason in out.text


async def test_huge_structured_result_is_serialised_only_up_to_the_limit() -> None:
    out = await Tool("t", "", {}, lambda: list(range(5_000_000))).call({}, 5, 300)
    assert out.truncated and out.error is None and len(out.text) <= 300
    assert out.text.startswith("[0, 1, 2") and "longer than 300 characters" in out.text
    small = await Tool("t", "", {}, lambda: [1, 2]).call({}, 5, 300)
    assert small.text == "[1, 2]" and not small.truncated
