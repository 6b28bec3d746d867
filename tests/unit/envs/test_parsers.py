"""Tool-call parsers: Hermes/Qwen JSON blocks and plain tags; hostile text never raises."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.parsers import HermesParser, TagParser, create_parser


def test_several_hermes_calls_in_one_turn() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    result = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in result.calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert result.errors == [] and result.content == "Let me check."


def test_no_call_is_a_final_answer() -> None:
    result = HermesParser().parse("The answer is 42.")
    assert not result.attempted and result.content == "The answer is 42."


def test_malformed_calls_are_reported_one_by_one() -> None:
    text = (
        "<tool_call>{not json}</tool_call>"
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "a", "arguments": "nope"}</tool_call>'
        '<tool_call>{"name": "ok"}</tool_call>'
        '<tool_call>{"name": "cut'
    )
    result = HermesParser().parse(text)
    assert [c.name for c in result.calls] == ["ok"]
    joined = "\n".join(result.errors)
    for fragment in [
        "tool call 1: invalid JSON",
        "tool call 2: expected a JSON object",
        'tool call 3: missing "name"',
        'tool call 4: "arguments" of a must be a JSON object',
        "tool call 5",
        "unterminated",
    ]:
        assert fragment in joined


def test_too_many_calls_and_oversize_calls() -> None:
    many = '<tool_call>{"name": "a"}</tool_call>' * 12
    result = HermesParser(max_calls=8).parse(many)
    assert len(result.calls) == 8 and "too many tool calls" in result.errors[0]
    big = '<tool_call>{"name": "a", "arguments": {"x": "' + "y" * 200 + '"}}</tool_call>'
    assert "exceeds" in HermesParser(max_call_chars=100).parse(big).errors[0]


def test_deeply_nested_json_is_an_error_not_a_crash() -> None:
    result = HermesParser().parse("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert result.errors and not result.calls


def test_tag_parser_takes_the_first_complete_action() -> None:
    parser = TagParser(("search", "answer"))
    result = parser.parse("<think>hmm</think> <search> capital of France </search> <answer>x</answer>")
    assert [(c.name, c.arguments) for c in result.calls] == [("search", {"text": "capital of France"})]
    assert parser.parse("no action here").attempted is False
    assert parser.parse("<search>unclosed").attempted is False


def test_create_parser_names_choices() -> None:
    assert isinstance(create_parser("tags", tags=("a",)), TagParser)
    try:
        create_parser("xml")
    except ValueError as exc:
        assert "hermes, tags" in str(exc)
    else:
        raise AssertionError("unknown parser accepted")


_PIECES = [*'<>/{}[]":,\\ \nabc01', "<tool_call>", "</tool_call>", '"name"', '"arguments"', "true", "null"]
hostile = st.lists(st.sampled_from(_PIECES), max_size=120).map("".join)


@settings(max_examples=400, deadline=None)
@given(hostile)
def test_hermes_parser_never_raises_on_hostile_text(text: str) -> None:
    result = HermesParser().parse(text)
    for call in result.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
    assert all(isinstance(e, str) for e in result.errors)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parsers_never_raise_on_random_unicode(text: str) -> None:
    HermesParser().parse(text)
    TagParser().parse(text)


_REGEX_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@settings(max_examples=300, deadline=None)
@given(hostile)
def test_linear_block_scan_matches_the_lazy_regex(text: str) -> None:
    # the reference: what `<tool_call>(.*?)</tool_call>` finds, and the old content rule
    spans, unterminated = HermesParser().blocks(text)
    expected = list(_REGEX_BLOCK.finditer(text))
    assert spans == [m.span(1) for m in expected]
    tail = text[expected[-1].end() :] if expected else text
    assert unterminated == ("<tool_call>" in tail)
    content = _REGEX_BLOCK.sub("", text).replace("<tool_call>", "").strip()
    assert HermesParser().parse(text).content == content


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<a>", "</a>", "<b>", "</b>", "x", " "]), max_size=40).map("".join))
def test_tag_scan_matches_the_lazy_regex(text: str) -> None:
    match = re.search(r"<(a|b)>(.*?)</\1>", text, re.S)
    result = TagParser(("a", "b")).parse(text)
    if match is None:
        assert not result.attempted
    else:
        assert [(c.name, c.arguments["text"]) for c in result.calls] == [
            (match.group(1), match.group(2).strip())
        ]


def test_unclosed_tags_scan_in_linear_time() -> None:
    # 5 MB of unclosed opening tags: a lazy regex rescans the rest of the text from each one
    # (10,000 of them took 44 s); the scan reads the text once
    result = HermesParser().parse("<tool_call>" * 450_000)
    assert result.errors == ["unterminated <tool_call> block: close each call with </tool_call>"]
    assert not TagParser().parse("<search>" * 600_000).attempted


def test_calls_beyond_the_limit_are_reported_with_their_count() -> None:
    result = HermesParser(max_calls=8).parse('<tool_call>{"name": "a"}</tool_call>' * 1000)
    assert len(result.calls) == 8 and result.dropped == 992
    assert "calls 9 to 1000 (992 calls) were not run" in result.errors[-1]
