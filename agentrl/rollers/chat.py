"""Incremental chat rendering for token-in, token-out episodes.

The agent loop never re-tokenizes what the model generated. It renders the prompt once,
keeps the sampled ids of every assistant turn, and appends environment turns as the
*difference* the chat template makes when those turns are added — computed on a fixed
dummy conversation, so earlier turns are never re-rendered. This sidesteps the known
breakers of "re-render the whole chat" approaches:

- templates that rewrite earlier assistant turns (Qwen3 strips past `<think>` blocks):
  we never re-render them;
- the text between the end of an assistant turn and the next turn (`<|im_end|>` then
  `\\n` in Qwen's layout): taken from the template itself, and only the part the model did
  not generate is appended (a turn cut by the length limit gets the whole closing text).

`consistent_with_full_render` checks, where the template allows it, that the incremental
text equals a full re-render of the conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_MARK = "\u2063agentrl-probe\u2063"  # text that never occurs in a real turn


def _render(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@dataclass
class ChatRenderer:
    """Renders prompts and environment turns for one tokenizer + tool set."""

    tokenizer: Any
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.eos_ids = {
            i for i in [tok.eos_token_id, *getattr(tok, "additional_eos_ids", [])] if i is not None
        }
        base = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": _MARK}]
        closed = _render(tok, base, self.tools, add_generation_prompt=False)
        end = closed.rindex(_MARK) + len(_MARK)
        # What the template writes after an assistant turn's content, e.g. "<|im_end|>\n".
        self.turn_close = closed[end:]
        self._base_text = closed
        self._base_messages = base
        self._prompts: dict[str, list[int]] = {}
        self._layouts: dict[tuple, list[str] | bool] = {}
        eos_text = tok.decode([tok.eos_token_id]) if tok.eos_token_id is not None else ""
        self._close_after_eos = (
            self.turn_close[len(eos_text) :] if eos_text and self.turn_close.startswith(eos_text) else None
        )

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        backend = self._backend()
        if backend is not None:  # the batch call releases the GIL while Rust encodes
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """The text of generated ids, end-of-turn tokens left out, special tokens kept."""
        kept = [i for i in ids if i not in self.eos_ids]
        backend = self._backend()
        if backend is not None:  # skips transformers' per-id Python type check (seconds at 1M ids)
            return backend.decode_batch([kept], skip_special_tokens=False)[0]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def _backend(self) -> Any:
        """The fast tokenizer's Rust backend, where calling it directly gives the same ids and text
        as the transformers wrapper (no clean-up of tokenization spaces); else None."""
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt rendered once, with the generation prompt (cached: a group's n episodes
        share their prompt)."""
        key = json.dumps(messages, sort_keys=True, default=str)
        ids = self._prompts.get(key)
        if ids is None:
            ids = self.encode(_render(self.tokenizer, messages, self.tools, add_generation_prompt=True))
            self._prompts[key] = ids
            if len(self._prompts) > 1024:
                self._prompts.pop(next(iter(self._prompts)))
        return list(ids)

    def close_turn_ids(self, output_ids: list[int]) -> list[int]:
        """Tokens that close an assistant turn the model ended (or that was cut off)."""
        if output_ids and output_ids[-1] in self.eos_ids and self._close_after_eos is not None:
            return self.encode(self._close_after_eos)
        return self.encode(self.turn_close)

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """Tokens of environment turns (tool results, user messages) plus the next generation
        prompt, as the template renders them after a closed assistant turn."""
        return self.encode(self.observation_text(messages))

    def observation_text(self, messages: list[dict]) -> str:
        """The template's text for `messages` after a closed assistant turn. Rendering the
        template is the roller's main per-turn cost, so the layout of each message shape
        (roles and keys) is rendered once with placeholder contents and reused — only when
        the template provably inserts contents verbatim (two different placeholders render
        to the same layout)."""
        shape = tuple((m.get("role"), tuple(sorted(k for k in m if k != "content"))) for m in messages)
        layout = self._layouts.get(shape)
        if layout is None:
            layout = self._layouts[shape] = self._layout(messages)
        if layout is False or not all(isinstance(m.get("content"), str) for m in messages):
            return self._render_delta(messages)
        # layout alternates literal text and slot numbers: [text, slot, text, slot, ..., text]
        return "".join(
            part if j % 2 == 0 else messages[int(part)]["content"] for j, part in enumerate(layout)
        )

    def _layout(self, messages: list[dict]) -> list[str] | bool:
        def filled(tag: str) -> list[dict]:
            return [{**m, "content": f"\u2063{tag}{i}\u2063"} for i, m in enumerate(messages)]

        try:
            a = self._render_delta(filled("slot"))
            b = self._render_delta(filled("alt x\n"))
        except Exception:
            return False
        same = a.replace("\u2063slot", "\u2063alt x\n") == b
        if not same or not all(a.count(f"\u2063slot{i}\u2063") == 1 for i in range(len(messages))):
            return False
        return re.split("\u2063slot(\\d+)\u2063", a)

    def _render_delta(self, messages: list[dict]) -> str:
        full = _render(
            self.tokenizer, [*self._base_messages, *messages], self.tools, add_generation_prompt=True
        )
        if not full.startswith(self._base_text):
            raise ValueError(
                "the chat template rewrites earlier turns when tool/user turns are added; "
                "incremental rendering cannot be used with it"
            )
        return full[len(self._base_text) :]

    def consistent_with_full_render(self, ids: list[int], messages: list[dict]) -> bool:
        """True if the incremental ids decode to exactly the template's full rendering of
        `messages` (assistant turns given as their decoded text). Templates that rewrite
        earlier turns (e.g. stripping `<think>`) legitimately fail this check."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        last_is_assistant = bool(messages) and messages[-1]["role"] == "assistant"
        full = _render(self.tokenizer, messages, self.tools, add_generation_prompt=not last_is_assistant)
        if text == full:
            return True
        # an episode that ends on an assistant turn stops right after the model's end-of-turn token
        return last_is_assistant and full.startswith(text) and self.turn_close.endswith(full[len(text) :])


def render_conversation(renderer: ChatRenderer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a whole conversation laid out exactly as the agent loop builds an
    episode: prompt once, each assistant turn as its content's tokens (mask 1) plus the
    end-of-turn token (or nothing, for a turn the env's stop string ended: `"end": "stop"`),
    env turns as the template's delta, and `observation` messages (raw text continuing the
    turn, as Search-R1-style envs return) verbatim (mask 0). Used for demonstrations."""
    split = next(
        (i for i, m in enumerate(messages) if m["role"] in ("assistant", "observation")), len(messages)
    )
    ids = renderer.prompt_ids(messages[:split])
    mask = [0] * len(ids)
    eos = renderer.tokenizer.eos_token_id
    pending: list[dict] = []
    last_turn: list[int] = []
    for message in messages[split:]:
        if message["role"] == "observation":
            context = renderer.encode(message["content"])
        elif message["role"] != "assistant":
            pending.append(message)
            continue
        else:
            context = []
        if pending:
            context = renderer.close_turn_ids(last_turn) + renderer.observation_ids(pending) + context
            pending = []
        ids += context
        mask += [0] * len(context)
        if message["role"] == "assistant":
            last_turn = renderer.encode(message["content"]) + ([] if message.get("end") == "stop" else [eos])
            ids += last_turn
            mask += [1] * len(last_turn)
    return ids, mask
