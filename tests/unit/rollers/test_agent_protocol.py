"""`parse_request`: every field the endpoint reads is checked, and a bad one is named in an OpenAI-style
400 (the request shapes the `openai` SDK sends; the end-to-end refusals are in test_agent_endpoint.py)."""

from __future__ import annotations

import pytest

from agentrl.rollers.agent_protocol import EndpointError, parse_request

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_a_full_request_comes_out_in_the_templates_form() -> None:
    chat = parse_request({
        "model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "red"},
        ],
        "tools": [TOOL], "tool_choice": "auto", "max_completion_tokens": 7, "stop": "END",
        "temperature": 1, "top_p": 0.5, "stream": True, "stream_options": {"include_usage": True},
        "continue_final_message": False,
    })  # fmt: skip
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.messages[2] == {"role": "assistant", "content": "",
                                "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"a": 1}}}]}  # fmt: skip
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p) == (7, ["END"], 1, 0.5)
    assert chat.tools == [TOOL] and chat.stream and chat.include_usage and not chat.continue_final


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"messages": USER, "tools": {"type": "function"}}, "tools"),
        ({"messages": USER, "stop": ["ok", 3]}, "stop"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "top_p": True}, "top_p"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": 0}, "max_tokens"),
        ({"messages": USER, "n": 3}, "n"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls[0]"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "tool"}]}, "messages[0].content"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ],
)  # fmt: skip
def test_a_bad_field_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(EndpointError) as refused:
        parse_request(body)
    assert refused.value.status == 400 and refused.value.param == param
    assert set(refused.value.body()["error"]) == {"message", "type", "param", "code"}


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(EndpointError, match="JSON object"):
        parse_request(["messages"])
