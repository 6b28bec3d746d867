"""The locally generated model: a real HF checkpoint with a Qwen2.5-layout chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.tiny_model import init_model

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

# The Qwen2.5-Instruct layout, written out by hand.
EXPECTED = (
    "<|im_start|>system\nYou are a calculator agent.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(CALC_TOOL)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 2+3 and 4*5?<|im_end|>\n"
    "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "calculator", "arguments": {"expression": "4*5"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n20\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n5 and 20.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

CONVERSATION = [
    {"role": "system", "content": "You are a calculator agent."},
    {"role": "user", "content": "What is 2+3 and 4*5?"},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}},
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "4*5"}'}},
        ],
    },
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "20"},
    {"role": "assistant", "content": "5 and 20."},
]


def test_checkpoint_loads_with_from_pretrained(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.model_type == "qwen2"
    assert (tiny_model / "model.safetensors").exists()
    assert len(tok) <= model.config.vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.encode("hello world", return_tensors="pt")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_chat_template_renders_tools_and_calls_in_the_qwen25_layout(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        CONVERSATION, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert text == EXPECTED


def test_chat_template_without_tools(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert (
        text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_python_functions_render_as_tools(tiny_model: Path) -> None:
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression to evaluate.
        """
        return expression

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tools=[calculator], tokenize=False)
    assert '"name": "calculator"' in text and "The expression to evaluate." in text


def test_special_and_tag_tokens_are_single_tokens(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for special in [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ]:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, special
        assert tok.decode(ids) == special


def test_byte_level_round_trip_and_digits_split(tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = EXPECTED + "ünïcödé ✓ 12345 \t\n  tabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids  # transformers uses our tokenizer.json as-is
    assert tok.decode(ids) == text
    digits = tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False))
    assert digits == ["1", "2", "3", "4", "5"]


def test_generation_stops_on_im_end(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_init_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = init_model("tiny", tmp_path / "a", seed=1)
    b = init_model("tiny", tmp_path / "b", seed=1)
    c = init_model("tiny", tmp_path / "c", seed=2)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(p) for p in (a, b, c))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (ma, mb, mc))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny, mini, small"):
        init_model("huge", tmp_path)


def test_toy_env_words_are_single_tokens(tiny_model: Path) -> None:
    from agentrl.envs.toy import LOOKUP_KEYS, LOOKUP_VALUES

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for word in LOOKUP_KEYS + LOOKUP_VALUES:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
