"""EM / substring EM / format checks on the cases that trip up answer matching."""

from __future__ import annotations

import pytest

from agentrl.envs.search.reward import (
    exact_match,
    extract_answer,
    normalize_answer,
    score_answer,
    substring_match,
    valid_format,
)


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Beatles", "beatles"),
        ("  a   Tale of Two Cities ", "tale of two cities"),
        ("Washington, D.C.", "washington dc"),
        ("“Hamlet”", "hamlet"),  # unicode quotes are punctuation too
        ("Rock–and–roll!", "rockandroll"),  # en dashes removed like ASCII hyphens
        ("ＮＡＳＡ", "nasa"),  # full-width letters fold to ASCII
        ("New\u00a0York", "new york"),  # non-breaking space is whitespace
        ("Zürich", "zürich"),  # accents are kept (SQuAD keeps them)
        ("Theatre", "theatre"),  # articles only as whole words
        ("An apple a day", "apple day"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_exact_match_against_any_gold_answer() -> None:
    golds = ["Barack Obama", "Obama", "Barack Hussein Obama II"]
    assert exact_match("obama.", golds) == 1.0
    assert exact_match("The Barack Obama", golds) == 1.0
    assert exact_match("Michelle Obama", golds) == 0.0
    assert exact_match("Paris", "paris") == 1.0  # a single gold answer as a string
    assert exact_match(None, golds) == 0.0
    assert exact_match("", ["the"]) == 1.0  # both normalise to empty, as in SQuAD
    assert exact_match("1,000", ["1000"]) == 1.0
    assert exact_match("1 000", ["1000"]) == 0.0


def test_substring_match_is_whole_words() -> None:
    assert substring_match("It was founded by Barack Obama in Chicago", ["Barack Obama"]) == 1.0
    assert substring_match("the answer is party", ["art"]) == 0.0
    assert substring_match("anything", [""]) == 0.0
    assert substring_match(None, ["x"]) == 0.0
    assert substring_match("“Hamlet”, by Shakespeare", ["hamlet"]) == 1.0


def test_extract_answer_takes_the_last_complete_answer() -> None:
    assert extract_answer("<answer> Paris </answer>") == "Paris"
    assert extract_answer("<answer>a</answer> then <answer>\n b \n</answer>") == "b"
    assert extract_answer("<answer> unfinished") is None
    assert extract_answer("no tags") is None


def test_valid_format_follows_the_protocol() -> None:
    good = (
        "<think>need facts</think>\n<search> q </search>\n\n<information>Doc 1(Title: x) y</information>\n\n"
        "<think>found</think> <answer> y </answer>"
    )
    assert valid_format(good)
    assert valid_format("<think>easy</think><answer>4</answer>")
    assert not valid_format("<answer>4</answer>")  # no reasoning first
    assert not valid_format("<think>a</think> stray text <answer>4</answer>")
    assert not valid_format("<think>a</think><search>q</search><answer>4</answer>")  # no information read
    assert not valid_format("<think>a</think><answer>4")


def test_score_answer() -> None:
    assert score_answer("Paris", ["paris"]) == 1.0
    assert score_answer("Lyon", ["paris"], format_ok=True, format_reward=0.2) == 0.2
    assert score_answer("Lyon", ["paris"], format_ok=False, format_reward=0.2) == 0.0
    assert score_answer(None, ["paris"], format_ok=True, format_reward=0.2) == 0.0
    assert score_answer("the city of Paris", ["paris"], metric="subem") == 1.0
    with pytest.raises(ValueError, match="em or subem"):
        score_answer("x", ["x"], metric="f1")
