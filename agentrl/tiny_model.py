"""Create small, real Hugging Face checkpoints locally, with no hub access.

Tests, benchmarks and the quickstart cannot download a model, so `agentrl init-model`
writes one: a Qwen2-architecture causal LM (or, for `tiny-moe`, a Qwen2-MoE one) with random weights and a byte-level BPE
tokenizer whose special tokens and chat template follow the Qwen2.5 layout (system
turn with `<tools>`, `<tool_call>` blocks, tool results merged into a user turn as
`<tool_response>` blocks). The result loads with the ordinary
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` calls that
users make with real Qwen checkpoints, so every code path stays the real one. The `-rm`
presets write a reward model instead: a `Qwen2ForSequenceClassification` with one scalar head
(`num_labels=1`, random weights), loaded by `AutoModelForSequenceClassification.from_pretrained`.

    agentrl init-model tiny /tmp/tiny
    agentrl init-model tiny-rm /tmp/tiny-rm
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Added tokens, in id order after the byte-level vocabulary and merges. The first
# three are Qwen2.5's control tokens; the tool tags are single tokens as in Qwen.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2's pre-tokenizer pattern: digits are split one by one, which keeps arithmetic
# learnable for a tiny model.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SYSTEM = "You are a helpful assistant."

# A Qwen2.5-style chat template written for agentrl. It renders the same layout as
# Qwen2.5-Instruct: tools listed one JSON schema per line inside <tools></tools>,
# assistant tool calls as <tool_call> JSON blocks, consecutive tool messages merged
# into one user turn of <tool_response> blocks, and `<|im_start|>assistant\n` as the
# generation prompt.
CHAT_TEMPLATE = (
    r"""{%- set default_system = '"""
    + DEFAULT_SYSTEM
    + r"""' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system_text = messages[0].content -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system_text = default_system -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' + system_text + '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}
{{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in rest -%}
  {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) -%}
{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
    {%- if message.content -%}
{{- '\n' + message.content -}}
    {%- endif -%}
    {%- for call in message.tool_calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set args = fn.arguments -%}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + (args if args is string else (args | tojson)) + '}\n</tool_call>' -}}
    {%- endfor -%}
{{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
    {%- endif -%}
{{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' -}}
    {%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
)


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a generated Qwen2 model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # total, including merges and added tokens (rounded up)
    classifier: bool = False  # a sequence classifier with a scalar head (a reward model)
    experts: int = 0  # > 0: a Qwen2-MoE model, every MLP a sparse block of this many experts
    experts_per_token: int = 2  # the router's top-k (MoE only)


PRESETS: dict[str, ModelPreset] = {
    # ~0.2M parameters: fast enough for every unit test.
    "tiny": ModelPreset(64, 2, 4, 2, 192, 1024),
    # ~1M parameters: the quickstart's model; learns the lookup task's copies within a minute on CPU.
    "mini": ModelPreset(128, 4, 4, 2, 384, 1024),
    # ~13M parameters.
    "small": ModelPreset(384, 8, 6, 2, 1024, 2048),
    # ~100M parameters: the size `agentrl bench sync` pushes.
    "base100m": ModelPreset(768, 12, 12, 4, 2048, 32768),
    # the tiny shape as a reward model (scalar head): `agentrl serve-reward` serves it in tests.
    "tiny-rm": ModelPreset(64, 2, 4, 2, 192, 1024, classifier=True),
    # the tiny shape as a Qwen2-MoE model: 4 experts of width 96 per layer, top-2 routing, one
    # shared expert; what the router-replay tests and the MoE quickstart use.
    "tiny-moe": ModelPreset(64, 2, 4, 2, 96, 1024, experts=4),
    # the mini shape as a Qwen2-MoE model (4 experts of width 192, top-2): the MoE quickstart's model.
    "mini-moe": ModelPreset(128, 4, 4, 2, 192, 1024, experts=4),
}


def qwen2_config(shape: ModelPreset, **fields):
    """The `Qwen2Config` of a preset's shape (tied embeddings), with `fields` added or overridden."""
    from transformers import Qwen2Config

    dims = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        tie_word_embeddings=True,
    )
    return Qwen2Config(**{**dims, **fields})


def qwen2_moe_config(shape: ModelPreset, **fields):
    """The `Qwen2MoeConfig` of an MoE preset: every layer sparse (`shape.experts` experts of width
    `intermediate_size`, top-`experts_per_token`, probabilities renormalised over the chosen experts),
    plus a shared expert of the same width; tied embeddings."""
    from transformers import Qwen2MoeConfig

    dims = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.intermediate_size,
        shared_expert_intermediate_size=shape.intermediate_size,
        num_experts=shape.experts,
        num_experts_per_tok=shape.experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        tie_word_embeddings=True,
    )
    return Qwen2MoeConfig(**{**dims, **fields})


def _training_corpus() -> list[str]:
    """Deterministic text the BPE merges are learned from: chat-template scaffolding,
    tool-call JSON, English and numbers, the text a tiny agent model mostly sees."""
    words = (
        "the of and to in is you that it for are as with his they be at one have this from or had by "
        "word but what some we can out other were all there when up use your how said an each she "
        "which do their time if will way about many then them would write like so these her long make "
        "thing see him two has look more day could go come did number sound no most people my over "
        "know water than call first who may down side been now find answer question search result "
        "function name arguments calculator add subtract multiply divide expression value tool user "
        "assistant system helpful query information document title final compute number equals"
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    snippets = [
        "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n",
        "<|im_start|>user\n",
        "<|im_start|>assistant\n",
        '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
        'expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", '
        '"description": "The expression."}}, "required": ["expression"]}}}',
        '{"name": "calculator", "arguments": {"expression": "12 + 7"}}',
        "You may call one or more functions to assist with the user query.",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "The answer is 42. <answer> 42 </answer> <search> query </search> <information> Doc 1(Title: x)",
        "def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    ]
    numbers = [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a in range(0, 40, 3) for b in range(1, 30, 7)]
    from agentrl.envs.toy import LOOKUP_KEYS, LOOKUP_VALUES

    # the toy lookup env's words become single tokens, bare and after a space
    words = LOOKUP_KEYS + LOOKUP_VALUES
    toy_words = [
        '"' + '" "'.join(words) + '"',
        "\n".join(words),
        " " + " ".join(words),
        "<lookup> <result> <answer> </lookup> </result> </answer> What colour is the today?",
    ]
    return (lines + snippets) * 20 + numbers + toy_words * 100


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers library) with Qwen2.5's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = SPECIAL_TOKENS + TAG_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)
    return tok


def _make_tokenizer_portable(out: Path) -> None:
    """Name the generic fast-tokenizer class and inline the chat template, so that
    transformers 4.x (as pinned by SGLang / vLLM wheels) and 5.x load the same files."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.pop("backend", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def init_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight Qwen2 (or Qwen2-MoE) checkpoint and its tokenizer to `out_dir`."""
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen2MoeForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    raw = build_tokenizer(shape.vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) <= shape.vocab_size, (len(tokenizer), shape.vocab_size)

    config = (qwen2_moe_config if shape.experts else qwen2_config)(
        shape,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **({"num_labels": 1} if shape.classifier else {}),
    )
    torch.manual_seed(seed)
    if shape.classifier:
        model = Qwen2ForSequenceClassification(config)
        with torch.no_grad():  # a random head at the init scale gives scores ~1e-2 apart; spread them
            model.score.weight.normal_(0.0, 1.0)
    else:
        model = (Qwen2MoeForCausalLM if shape.experts else Qwen2ForCausalLM)(config)
        if shape.experts:  # transformers zero-initialises the router: give it the init scale
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.mlp.gate.weight.normal_(0.0, config.initializer_range)
        model.generation_config.eos_token_id = [config.eos_token_id, config.bos_token_id]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_tokenizer_portable(out)
    (out / "agentrl_model.json").write_text(
        json.dumps({"preset": preset, "seed": seed, "num_parameters": model.num_parameters()}, indent=2)
    )
    return out
