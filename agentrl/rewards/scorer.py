"""A reward model loaded for scoring: a sequence classifier's scalar head, or a judge's verdict.

    scorer = load_scorer("runs/models/tiny-rm", RewardConfig())
    scores = scorer.score(scorer.render([messages_a, messages_b]))

Both kinds load with the ordinary Hugging Face `from_pretrained`, after a look at the
checkpoint's `config.json` so that the wrong kind of model is refused up front, naming what it is:

- classifier: `AutoModelForSequenceClassification` with `num_labels == 1` (e.g.
  `Qwen2ForSequenceClassification`, as TRL's `RewardTrainer` trains). A conversation is rendered
  with the reward model's own chat template (its tokenizer, not the policy's) and the score is
  the head's logit at the last token — the model's own pooling.
- judge: `AutoModelForCausalLM`. The conversation is written out as `role: content` lines into
  `judge_prompt`, which is rendered as one user turn with the generation prompt; the score is the
  next-token probability (or log-probability) of `verdict`'s first token.

Inputs longer than `max_tokens` keep their last tokens (the answer is at the end).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from agentrl.rewards.config import RewardConfig

STANDARD_ROLES = {"system", "user", "assistant", "tool"}
# agent_loop's roles for raw-text envs: the opening prompt and verbatim observations
ROLE_ALIASES = {"prompt": "user", "observation": "user"}


class WrongModelType(ValueError):
    """The checkpoint is not the kind of model `reward.kind` asks for."""


def _architectures(path: str) -> list[str]:
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return list(json.loads(config_file.read_text()).get("architectures") or [])
    from transformers import AutoConfig  # a hub id

    return list(AutoConfig.from_pretrained(path).architectures or [])


def check_model_type(path: str, kind: str) -> str:
    """The architecture that fits `kind`, else `WrongModelType` saying what the checkpoint is."""
    archs = _architectures(path)
    suffixes = ("ForSequenceClassification",) if kind == "classifier" else ("ForCausalLM", "LMHeadModel")
    for arch in archs:
        if arch.endswith(suffixes):
            return arch
    hint = (
        "a sequence classifier with a scalar head (agentrl init-model tiny-rm DIR makes one), or "
        "set reward.kind: judge for a causal LM"
        if kind == "classifier"
        else "a causal LM, or set reward.kind: classifier for a sequence classifier"
    )
    raise WrongModelType(
        f"reward.model: {path} is {archs or 'of no named architecture'}; reward.kind={kind} needs {hint}"
    )


def normalise(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages with standard roles and string content (what chat templates accept)."""
    out = []
    for i, m in enumerate(messages):
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in STANDARD_ROLES:
            raise ValueError(f"message {i}: unknown role {m.get('role')!r}")
        content = m.get("content")
        out.append({"role": role, "content": content if isinstance(content, str) else json.dumps(content)})
    return out


def plain_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class Scorer:
    """A loaded reward model. `score` is synchronous and runs the forward; callers batch."""

    def __init__(self, path: str, config: RewardConfig, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.config = config
        self.kind = config.kind
        self.architecture = check_model_type(path, config.kind)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        auto = AutoModelForSequenceClassification if self.kind == "classifier" else AutoModelForCausalLM
        self.model = auto.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.device = device
        if self.kind == "classifier":
            if self.model.config.num_labels != 1:
                raise WrongModelType(
                    f"reward.model: {path} has {self.model.config.num_labels} labels; a reward model has "
                    "one scalar head (num_labels 1)"
                )
            if self.model.config.pad_token_id is None:
                self.model.config.pad_token_id = self.tokenizer.pad_token_id
            self.verdict_id = None
        else:
            ids = self.tokenizer.encode(config.verdict, add_special_tokens=False)
            if not ids:
                raise ValueError(f"reward.verdict: {config.verdict!r} encodes to no token")
            self.verdict_id = ids[0]

    def render(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        """The text each conversation is scored as (what `score` takes)."""
        texts = []
        for messages in conversations:
            messages = normalise(messages)
            if self.kind == "judge":
                prompt = self.config.judge_prompt.replace("{transcript}", plain_text(messages))
                texts.append(self._template([{"role": "user", "content": prompt}], generation=True))
            else:
                texts.append(self._template(messages, generation=False))
        return texts

    def _template(self, messages: list[dict[str, str]], generation: bool) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
        return plain_text(messages) + ("\nassistant:" if generation else "")

    def score(self, texts: list[str]) -> list[float]:
        """One forward (per `max_batch_size` texts); a score per text."""
        import torch

        out: list[float] = []
        step = self.config.max_batch_size
        for start in range(0, len(texts), step):
            enc = self.tokenizer(
                texts[start : start + step],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.config.max_tokens,
                add_special_tokens=False,
            ).to(self.device)
            with torch.inference_mode():
                logits = self.model(**enc).logits.float()
            if self.kind == "classifier":
                out += logits[:, 0].tolist()
                continue
            last = enc["attention_mask"].sum(dim=1) - 1
            logp = logits[torch.arange(len(last)), last].log_softmax(dim=-1)[:, self.verdict_id]
            out += logp.tolist() if self.config.judge_score == "logprob" else logp.exp().tolist()
        bad = [s for s in out if not math.isfinite(s)]
        if bad:
            raise ValueError(f"reward model produced {len(bad)} non-finite score(s)")
        return out


def load_scorer(path: str, config: RewardConfig, device: str = "cpu") -> Scorer:
    return Scorer(path, config, device)
