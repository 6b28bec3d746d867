"""The `reward` section of a run: whether a served reward model scores episodes, and how.

Kept beside the reward-model code (not in `agentrl/config.py`, which only adds the field) so
that the section and its users change together. Plain pydantic with the same rules as every
other section: unknown keys fail, each field's docstring is its help.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agentrl.section import Section

DEFAULT_JUDGE_PROMPT = (
    "Here is a conversation between a user and an assistant.\n\n{transcript}\n\n"
    "Did the assistant answer the user correctly? Answer yes or no."
)


class RewardConfig(Section):
    """A served reward model (`agentrl serve-reward`) that scores every episode.

    An episode's reward becomes `env reward + weight × score`, the score coming from the model
    at `url`."""

    url: str | None = None
    """Address of a running `agentrl serve-reward` (e.g. http://127.0.0.1:30100); unset means no
    reward model: episodes keep the env's reward."""
    model: str | None = None
    """Checkpoint `agentrl serve-reward` loads when started from this config (a directory or hub
    id); the roller reads only `url`."""
    kind: Literal["classifier", "judge"] = "classifier"
    """classifier: a sequence classifier with one scalar head (AutoModelForSequenceClassification,
    num_labels 1), score = its logit. judge: a causal LM asked `judge_prompt`, score = the
    probability (or log-probability, `judge_score`) of the `verdict` token as its next token."""
    weight: float = 1.0
    """Weight of the model's score in the episode's reward (the env's reward has weight 1)."""
    judge_prompt: str = DEFAULT_JUDGE_PROMPT
    """kind=judge: the user turn put to the judge; `{transcript}` is replaced by the episode."""
    verdict: str = "yes"
    """kind=judge: the text whose first token's next-token probability is the score."""
    judge_score: Literal["prob", "logprob"] = "prob"
    """kind=judge: report P(verdict) in [0, 1] or log P(verdict) (≤ 0)."""
    max_tokens: int = Field(2048, ge=16)
    """Longest scored input in the reward model's tokens; longer ones keep their last tokens."""
    timeout_s: float = Field(30.0, gt=0)
    """A score request that takes longer (or a scorer that cannot be reached) fails the group,
    with the address in the error."""
    max_batch_size: int = Field(32, ge=1)
    """Most transcripts per forward (server) and per request (roller)."""
    batch_wait_ms: float = Field(5.0, ge=0)
    """How long the first transcript of a batch waits for others to join it."""

    @model_validator(mode="after")
    def _judge_prompt_has_slot(self) -> RewardConfig:
        if self.kind == "judge" and "{transcript}" not in self.judge_prompt:
            raise ValueError("reward.judge_prompt: must contain {transcript}, where the episode goes")
        if not self.verdict:
            raise ValueError("reward.verdict: must not be empty")
        return self
