"""Exact-match rewards for open-domain QA: SQuAD-style normalisation, EM, substring EM, format.

The same definitions as Search-R1's `verl/utils/reward_score/qa_em.py` (and SQuAD's
evaluation script): lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace; EM is equality with any gold answer after normalisation, substring EM is
containment of any normalised gold answer. Two deliberate extensions, both only ever
making more answers match, never fewer: Unicode punctuation (“ ” – — « » ¿ …) is
dropped along with ASCII punctuation, and text is NFKC-folded first (full-width letters,
ligatures, non-breaking spaces). One deliberate difference the other way: substring EM
matches whole words only (Search-R1 checks characters, so its gold "art" is found in
"party").

`valid_format` is the structure check behind Search-R1's optional format reward
(`qa_em_format.py`): think → (search → information → think)* → answer, nothing outside
tags but whitespace.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCT = set(string.punctuation)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, strip punctuation, strip articles, collapse whitespace."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text if not _is_punct(ch))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golden_answers: str | Iterable[str]) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in golden_answers]


def exact_match(prediction: str | None, golden_answers: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golden_answers)))


def substring_match(prediction: str | None, golden_answers: str | Iterable[str]) -> float:
    """1.0 if any normalised gold answer occurs in the normalised prediction, else 0.0.

    Matching is on whole words, so the gold "art" is not found in "party"; an empty gold
    answer never matches."""
    if prediction is None:
        return 0.0
    pred = f" {normalize_answer(prediction)} "
    return float(any((gold := normalize_answer(g)) and f" {gold} " in pred for g in _golds(golden_answers)))


def extract_answer(text: str) -> str | None:
    """The content of the last complete `<answer>…</answer>` in `text`, stripped; None if there is none."""
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None


_TAG = re.compile(r"(</?(?:think|search|information|answer)>)")
# state -> {tag: next state}; text between tags is allowed only inside think/search/information/answer
_TRANSITIONS = {
    "start": {"<think>": "think"},
    "think": {"</think>": "thought"},
    "thought": {"<search>": "search", "<answer>": "answer"},
    "search": {"</search>": "searched"},
    "searched": {"<information>": "information"},
    "information": {"</information>": "informed"},
    "informed": {"<think>": "think"},
    "answer": {"</answer>": "end"},
    "end": {},
}
_TEXT_INSIDE = {"think", "search", "information", "answer"}


def valid_format(text: str) -> bool:
    """Whether the model's whole output (with the env's `<information>` blocks) follows the protocol."""
    state = "start"
    for part in _TAG.split(text):
        if not part.strip():
            continue
        if _TAG.fullmatch(part):
            state = _TRANSITIONS[state].get(part, "")
            if not state:
                return False
        elif state not in _TEXT_INSIDE:
            return False
    return state == "end"


def score_answer(
    answer: str | None,
    golden_answers: str | Iterable[str],
    metric: str = "em",
    format_ok: bool = False,
    format_reward: float = 0.0,
) -> float:
    """The episode reward: 1 for a correct answer, `format_reward` for a wrong one in a valid format.

    `metric` is `em` or `subem`. Search-R1's `compute_score_em(format_score=...)` gives the
    same partial credit to any wrong answer; here it also needs a well-formed transcript."""
    match = {"em": exact_match, "subem": substring_match}.get(metric)
    if match is None:
        raise ValueError(f"unknown answer metric {metric!r}; choose em or subem")
    if match(answer, golden_answers):
        return 1.0
    return format_reward if answer is not None and format_ok else 0.0
