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
        eos_text = tok.decode([tok.eos_token_id]) if tok.eos_token_id is not None else ""
        self._close_after_eos = (
            self.turn_close[len(eos_text) :] if eos_text and self.turn_close.startswith(eos_text) else None
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt rendered once, with the generation prompt."""
        return self.encode(_render(self.tokenizer, messages, self.tools, add_generation_prompt=True))

    def close_turn_ids(self, output_ids: list[int]) -> list[int]:
        """Tokens that close an assistant turn the model ended (or that was cut off)."""
        if output_ids and output_ids[-1] in self.eos_ids and self._close_after_eos is not None:
            return self.encode(self._close_after_eos)
        return self.encode(self.turn_close)

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """Tokens of environment turns (tool results, user messages) plus the next generation
        prompt, as the template renders them after a closed assistant turn."""
        full = _render(
            self.tokenizer, [*self._base_messages, *messages], self.tools, add_generation_prompt=True
        )
        if not full.startswith(self._base_text):
            raise ValueError(
                "the chat template rewrites earlier turns when tool/user turns are added; "
                "incremental rendering cannot be used with it"
            )
        return self.encode(full[len(self._base_text) :])

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
    episode: prompt once, each assistant turn as its content's tokens plus the end-of-turn
    token (mask 1), env turns as the template's delta (mask 0). Used for demonstrations."""
    split = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = renderer.prompt_ids(messages[:split])
    mask = [0] * len(ids)
    eos = renderer.tokenizer.eos_token_id
    pending: list[dict] = []
    last_turn: list[int] = []
    for message in messages[split:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            context = renderer.close_turn_ids(last_turn) + renderer.observation_ids(pending)
            ids += context
            mask += [0] * len(context)
            pending = []
        last_turn = [*renderer.encode(message["content"]), eos]
        ids += last_turn
        mask += [1] * len(last_turn)
    return ids, mask
