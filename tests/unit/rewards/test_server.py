"""`agentrl serve-reward`'s app on a real socket: scores equal a direct Hugging Face forward of
the same checkpoint, concurrent requests share a forward, the wrong model kind and bad input are
refused with a message."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from agentrl.rewards.config import RewardConfig
from agentrl.rewards.scorer import WrongModelType, load_scorer
from agentrl.rewards.server import make_app

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "What colour is the fox?"}, {"role": "assistant", "content": "<lookup> fox </lookup>"},
     {"role": "tool", "content": "red"}, {"role": "assistant", "content": "<answer> red </answer>"}],
    [{"role": "prompt", "content": "Question: who?"}, {"role": "assistant", "content": "me"},
     {"role": "observation", "content": "<result> you </result>"}],
]  # fmt: skip


def hf_classifier_scores(path: Path, conversations: list[list[dict]]) -> list[float]:
    """The reference: each conversation alone (no padding) through the HF classifier."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    roles = {"prompt": "user", "observation": "user"}
    out = []
    for conv in conversations:
        messages = [{"role": roles.get(m["role"], m["role"]), "content": m["content"]} for m in conv]
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out.append(model(input_ids=ids["input_ids"]).logits[0, 0].item())
    return out


async def post(url: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + "/score", json=body) as r:
        return r.status, await r.json()


async def test_classifier_scores_equal_a_direct_hf_forward_and_requests_share_forwards(
    tiny_rm, serve_app
) -> None:
    scorer = load_scorer(str(tiny_rm), RewardConfig(max_batch_size=3, batch_wait_ms=5000))
    url = await serve_app(make_app(scorer))
    # three single-conversation requests at once: the batch fills (3) and runs as one forward
    replies = await asyncio.gather(*(post(url, {"conversations": [c]}) for c in CONVERSATIONS))
    expected = hf_classifier_scores(tiny_rm, CONVERSATIONS)
    assert [status for status, _ in replies] == [200, 200, 200]
    assert [body["batch_size"] for _, body in replies] == [3, 3, 3]
    got = [body["scores"][0] for _, body in replies]
    assert got == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 3) for s in expected}) == 3  # the head tells the transcripts apart
    status, body = await post(url, {"texts": scorer.render(CONVERSATIONS)})  # texts: scored as given
    assert status == 200 and body["scores"] == pytest.approx(expected, abs=1e-4)
    async with aiohttp.ClientSession() as s, s.get(url + "/model_info") as r:
        info = await r.json()
    assert info["kind"] == "classifier" and info["architecture"] == "Qwen2ForSequenceClassification"


async def test_judge_scores_are_the_verdict_tokens_next_token_probability(tiny_model, serve_app) -> None:
    config = RewardConfig(kind="judge", verdict="yes", judge_prompt="Judge this:\n{transcript}\nCorrect?")
    url = await serve_app(make_app(load_scorer(str(tiny_model), config)))
    status, body = await post(url, {"conversations": CONVERSATIONS[:2]})
    assert status == 200
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    yes = tok.encode("yes", add_special_tokens=False)[0]
    expected = []
    for conv in CONVERSATIONS[:2]:
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in conv)
        prompt = [{"role": "user", "content": f"Judge this:\n{transcript}\nCorrect?"}]
        ids = tok.apply_chat_template(
            prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            logits = model(input_ids=ids["input_ids"]).logits[0, -1]
        expected.append(logits.softmax(-1)[yes].item())
    assert body["scores"] == pytest.approx(expected, rel=1e-4)
    assert all(0 < s < 1 for s in body["scores"])


def test_the_wrong_kind_of_model_is_refused_naming_it(tiny_model, tiny_rm) -> None:
    with pytest.raises(
        WrongModelType, match=r"Qwen2ForCausalLM.*reward.kind=classifier needs a sequence classifier"
    ):
        load_scorer(str(tiny_model), RewardConfig(kind="classifier"))
    with pytest.raises(
        WrongModelType, match=r"Qwen2ForSequenceClassification.*reward.kind=judge needs a causal LM"
    ):
        load_scorer(str(tiny_rm), RewardConfig(kind="judge"))


async def test_bad_input_is_a_400_with_a_message(tiny_rm, serve_app) -> None:
    url = await serve_app(make_app(load_scorer(str(tiny_rm), RewardConfig(batch_wait_ms=0))))
    cases = [
        ({}, "exactly one of conversations or texts"),
        ({"texts": ["a"], "conversations": [[]]}, "exactly one"),
        ({"texts": [1]}, "texts.0"),
        ({"conversations": [[{"role": "wizard", "content": "x"}]]}, "unknown role 'wizard'"),
        ({"conversations": "nope"}, "conversations"),
    ]
    for body, message in cases:
        status, reply = await post(url, body)
        assert status == 400 and message in reply["error"]["message"], (body, reply)
    async with aiohttp.ClientSession() as s, s.post(url + "/score", data=b"{not json") as r:
        assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]
    status, reply = await post(url, {"texts": ["still serving"]})  # nothing above disturbed it
    assert status == 200 and len(reply["scores"]) == 1
