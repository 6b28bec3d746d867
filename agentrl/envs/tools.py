"""Tools as plain Python functions: `@tool`, JSON schemas from type hints, safe calls.

    @tool
    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12 * (3 + 4)".
        '''

The schema (OpenAI function format) comes from the signature and the Google-style
docstring; arguments the model writes are validated against the signature with
pydantic before the function runs. `Tool.call` never raises for anything the model
did: unknown or wrong-typed arguments, an exception inside the tool, a timeout, or a
result that cannot be shown (an integer past Python's 4,300-digit str limit, a recursive or
too deeply nested structure, an object whose `str` raises) all come back as a `ToolOutput`
whose text is an error message the model can learn from, with `error` naming the kind
(counted in episode metrics). A huge result is cut with a marker; a non-string one is
serialised only up to the limit, so a billion-element list costs no more than a short one.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import pydantic

_PRIMITIVES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def type_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema of a Python type hint, in the compact form chat templates show."""
    if annotation in _PRIMITIVES:
        return {"type": _PRIMITIVES[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    if annotation in (Any, inspect.Parameter.empty):
        return {}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return _enum_schema(args)
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args)
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set):
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    if origin is dict or annotation is dict:
        return {
            "type": "object",
            **({"additionalProperties": type_schema(args[1])} if len(args) == 2 else {}),
        }
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_schema(tuple(m.value for m in annotation))
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation.model_json_schema()
    raise TypeError(f"cannot describe type {annotation!r} in a tool schema")


def _enum_schema(values: tuple[Any, ...]) -> dict[str, Any]:
    """A `Literal[...]` or an Enum's values; typed when they share one primitive type."""
    kinds = {_PRIMITIVES.get(type(v)) for v in values}
    schema: dict[str, Any] = {"enum": list(values)}
    if len(kinds) == 1 and None not in kinds:
        schema["type"] = kinds.pop()
    return schema


def _union_schema(args: tuple[Any, ...]) -> dict[str, Any]:
    """`X | None` is X's schema with a nullable type; a wider union is `anyOf` its members."""
    non_null = [a for a in args if a is not type(None)]
    inner = type_schema(non_null[0]) if len(non_null) == 1 else {"anyOf": [type_schema(a) for a in non_null]}
    if len(non_null) < len(args) and "type" in inner and isinstance(inner["type"], str):
        return {**inner, "type": [inner["type"], "null"]}
    return inner


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    text = inspect.cleandoc(doc)
    parts = re.split(
        r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?):\s*$", text, flags=re.M
    )
    description = parts[0].strip()
    params: dict[str, str] = {}
    for header, body in zip(parts[1::2], parts[2::2], strict=False):
        if header not in ("Args", "Arguments", "Parameters"):
            continue
        current = None
        for line in body.splitlines():
            match = re.match(r"^\s{0,8}(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if match:
                current = match.group(1).lstrip("*")
                params[current] = match.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


@dataclass
class ToolOutput:
    """What a tool call produced: text for the model, and an error kind if it failed."""

    text: str
    error: str | None = None  # unknown_tool | bad_arguments | raised | timeout | bad_result | None
    truncated: bool = False


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Cut `text` to `limit` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text, False
    kept = limit
    for _ in range(3):  # the marker's own length depends on the count it reports
        marker = f"\n...[truncated {len(text) - kept} characters]"
        kept = max(0, limit - len(marker))
    return text[:kept] + f"\n...[truncated {len(text) - kept} characters]", True


@dataclass
class Tool:
    """A callable the model may invoke, with its OpenAI-format schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] | None = None
    validator: type[pydantic.BaseModel] | None = field(default=None, repr=False)
    invoke: Callable[[dict[str, Any]], Awaitable[Any]] | None = field(default=None, repr=False)

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=[...]`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def bind(self, instance: object) -> Tool:
        """The tool with `self` bound, for tools declared as methods of a ToolEnv."""
        if self.fn is None:
            return self
        return Tool(self.name, self.description, self.parameters, self.fn.__get__(instance), self.validator)

    def check_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validated, coerced keyword arguments; raises ValueError with a model-readable message."""
        if self.validator is None:
            return arguments
        try:
            model = self.validator.model_validate(arguments)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg'].lower()}" for e in exc.errors()
            )
            raise ValueError(problems) from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    async def call(self, arguments: dict[str, Any], timeout_s: float, max_chars: int) -> ToolOutput:
        """Run the tool; every failure becomes an error observation, never an exception."""
        try:
            kwargs = self.check_arguments(arguments)
        except ValueError as exc:
            return ToolOutput(f"Error: invalid arguments for {self.name}: {exc}", error="bad_arguments")
        try:
            if self.invoke is not None:
                result = await asyncio.wait_for(self.invoke(kwargs), timeout_s)
            elif inspect.iscoroutinefunction(self.fn):
                result = await asyncio.wait_for(self.fn(**kwargs), timeout_s)
            else:
                # Sync tools run in a worker thread so a slow one cannot stall other episodes. A thread cannot
                # be killed: a tool that hangs forever keeps its thread. Untrusted code belongs in a sandbox.
                result = await asyncio.wait_for(asyncio.to_thread(self.fn, **kwargs), timeout_s)
        except TimeoutError:
            return ToolOutput(f"Error: {self.name} timed out after {timeout_s:g}s", error="timeout")
        except Exception as exc:
            return ToolOutput(f"Error: {self.name} failed: {type(exc).__name__}: {exc}", error="raised")
        try:
            # JSON of a deep structure yields each piece through one generator per level: seconds
            # for a hostile result, so anything but a string is serialised in a worker thread
            if isinstance(result, str):
                text, cut = truncate(result, max_chars)
            else:
                text, cut = await asyncio.to_thread(result_text, result, max_chars)
        except Exception as exc:  # ValueError (huge int, circular), RecursionError, a raising __str__
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
            return ToolOutput(
                f"Error: {self.name} returned a result that cannot be shown ({reason})", "bad_result"
            )
        return ToolOutput(text, truncated=cut)


def result_text(result: Any, max_chars: int) -> tuple[str, bool]:
    """(text, truncated) of a tool's return value: strings as they are, anything else as JSON
    (`str` for what JSON cannot hold). The JSON is produced piece by piece and stops once it
    passes `max_chars`, so the cost is bounded by the limit, not by the result's size."""
    if isinstance(result, str):
        return truncate(result, max_chars)
    pieces, size = [], 0
    for piece in json.JSONEncoder(default=str).iterencode(result):
        pieces.append(piece)
        size += len(piece)
        if size > max_chars:
            marker = f"\n...[truncated: the result is longer than {max_chars} characters]"
            return "".join(pieces)[: max(0, max_chars - len(marker))] + marker, True
    return truncate("".join(pieces), max_chars)


def _validator_for(fn: Callable[..., Any], name: str) -> type[pydantic.BaseModel]:
    fields: dict[str, Any] = {}
    hints = typing.get_type_hints(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = hints.get(pname, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, default)
    config = pydantic.ConfigDict(extra="forbid")
    return pydantic.create_model(f"{name}_arguments", __config__=config, **fields)


def make_tool(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
    """Build a Tool from a function's signature and docstring."""
    name = name or fn.__name__
    doc_description, doc_params = parse_docstring(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = type_schema(hints.get(pname, Any))
        if pname in doc_params:
            prop["description"] = doc_params[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        properties[pname] = prop
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name, description or doc_description, parameters, fn, _validator_for(fn, name))


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Decorator: mark a function (or a ToolEnv method) as a tool. Usable bare or with arguments."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__agentrl_tool__ = make_tool(f, name=name, description=description)  # type: ignore[attr-defined]
        return f

    return wrap(fn) if fn is not None else wrap


def as_tool(obj: Callable[..., Any] | Tool) -> Tool:
    """A Tool from a Tool, an @tool-decorated function or a plain function."""
    if isinstance(obj, Tool):
        return obj
    marked = getattr(obj, "__agentrl_tool__", None)
    if marked is not None:
        return marked if not inspect.ismethod(obj) else marked.bind(obj.__self__)
    return make_tool(obj)
