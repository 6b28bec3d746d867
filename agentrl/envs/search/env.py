"""The Search-R1 environment: reason, `<search>`, read `<information>`, `<answer>`; reward = EM.

    env:
      name: search_r1
      kwargs: {retriever_url: "http://127.0.0.1:8000/retrieve", topk: 3, max_turns: 4}

Protocol (Search-R1's `search_r1/llm_agent/generation.py`): generation stops at
`</search>` or `</answer>`. A search turn gets the top-k documents appended verbatim to the
same assistant turn as `\\n\\n<information>Doc 1(Title: …) …</information>\\n\\n` (loss mask
0); an answer ends the episode; anything else gets a corrective message and another try.
After `max_turns` turns the next one is the last: it is not searched for, whatever it says
ends the episode (so set `roller.max_turns` to at least `max_turns + 1`). Reward: exact
match of the last `<answer>` against the gold answers, optionally `subem`, optionally a
small `format_reward` for a wrong answer in a well-formed transcript.

`SearchToolEnv` is the tool-calling variant: `search` is a `@tool` rendered through the
chat template, results come back as tool messages, the final message answers.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from agentrl.envs.base import Env, Messages, Service, StepResult, Transcript, live_services
from agentrl.envs.parsers import TagParser
from agentrl.envs.search.client import RetrieverClient, format_passages
from agentrl.envs.search.data import normalize_task
from agentrl.envs.search.reward import (
    exact_match,
    extract_answer,
    score_answer,
    substring_match,
    valid_format,
)
from agentrl.envs.search.synthetic import synthetic_tasks
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool

# Says what Search-R1's `make_prefix(template_type="base")` says
# (scripts/data_process/qa_search_train_merge.py), in our own words, with the same tags.
PROMPT_TEMPLATE = (
    "Answer the question below. Each time you get new information, reason about it first "
    "inside <think> and </think>. If that reasoning shows you are missing some knowledge, "
    "query a search engine by writing <search> query </search>, and the top results will be "
    "given back between <information> and </information>. You may search as often as you "
    "like. Once no further outside knowledge is needed, give the answer inside <answer> and "
    "</answer> without a detailed explanation, for example <answer> Beijing </answer>. "
    "Question: {question}\n"
)

# Says what Search-R1's message for an invalid action says (search_r1/llm_agent/generation.py,
# `execute_predictions`), in our own words, in the model's voice, with the same tags.
CORRECTION = (
    "\nThat action was not valid. To search, I have to write the query between <search> and "
    "</search>. To give the final answer, I have to write it between <answer> and </answer>. "
    "Let me try again.\n"
)

DEFAULT_URL = "http://127.0.0.1:8000/retrieve"


def information_block(hits: list[Any]) -> str:
    """The observation appended after a search: Search-R1's `<information>` block."""
    return f"\n\n<information>{format_passages(hits).strip()}</information>\n\n"


def synthetic_retriever(kwargs: dict[str, Any], task_kwargs: dict[str, Any], run_dir: str) -> list[Service]:
    """With `retriever_url: auto`, `agentrl run` serves the synthetic world's corpus itself."""
    if kwargs.get("retriever_url") != "auto":
        return []
    data = f"{run_dir}/retriever_data"
    return [
        Service(
            "retriever",
            ["retriever", "--make-synthetic", data, "--corpus", f"{data}/corpus.jsonl", "--port", "{port}",
             "--seed", str(task_kwargs.get("world_seed", 0)),
             "--num-people", str(task_kwargs.get("num_people", 200))],
            kwarg="retriever_url",
            url_path="/retrieve",
        )
    ]  # fmt: skip


QA_TASK_FIELDS = ("question", ("golden_answers", "answers", "answer", "reward_model"))
"""What `normalize_task` needs of a record: a question and its gold answers in one of the layouts."""


class _Retrieval:
    """What both Search-R1 envs do with the retriever: check its settings, follow it when the
    launcher moves it (`live_services`), open one client per episode lazily and close it, and the
    synthetic questions and retriever a run without data starts."""

    def _init_retrieval(self, retriever_url: str, topk: int, metric: str, retriever_timeout_s: float) -> None:
        if metric not in ("em", "subem"):
            raise ValueError(f"metric must be em or subem, got {metric!r}")
        if retriever_url == "auto":
            raise ValueError(
                "env.kwargs.retriever_url: `auto` is resolved by `agentrl run` only; give the URL"
            )
        self.retriever_url = retriever_url
        self.topk = topk
        self.metric = metric
        self.retriever_timeout_s = retriever_timeout_s
        self._client: RetrieverClient | None = None

    def _current_url(self) -> str:  # the retriever where it is now, if the launcher moved it
        return live_services.url("retriever_url", self.retriever_url)

    def client(self) -> RetrieverClient:
        if self._client is None:
            self._client = RetrieverClient(self._current_url, self.topk, timeout_s=self.retriever_timeout_s)
        return self._client

    def close(self) -> Awaitable[None] | None:
        """Close the retriever connection; awaitable only when one was opened."""
        client, self._client = self._client, None
        return client.close() if client is not None else None

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
        """Synthetic questions (see `synthetic.py`): `split` (train/test), `world_seed`, `num_people`."""
        return synthetic_tasks(num, seed=seed, **kwargs)

    services = staticmethod(synthetic_retriever)


class SearchR1Env(_Retrieval, Env):
    """Search-augmented QA with the `<search>` / `<answer>` tag protocol."""

    stop = ("</search>", "</answer>")
    required_task_fields = QA_TASK_FIELDS

    def __init__(
        self,
        retriever_url: str = DEFAULT_URL,
        topk: int = 3,
        max_turns: int = 4,
        metric: str = "em",
        format_reward: float = 0.0,
        prompt_template: str = PROMPT_TEMPLATE,
        retriever_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template must contain {question}")
        self._init_retrieval(retriever_url, topk, metric, retriever_timeout_s)
        self.max_turns = max_turns
        self.format_reward = format_reward
        self.prompt_template = prompt_template
        self.parser = TagParser(("search", "answer"))
        self.task: dict[str, Any] = {}
        self.turns = 0
        self.answer: str | None = None
        self.metrics = {"search_calls": 0, "invalid_actions": 0, "tool_calls": 0, "tool_errors": 0}

    def reset(self, task: dict[str, Any]) -> Messages:
        self.task = normalize_task(task)
        self.metrics["data_source"] = self.task["data_source"]
        return [{"role": "user", "content": self.prompt_template.format(question=self.task["question"])}]

    async def step(self, action_text: str) -> StepResult:
        self.turns += 1
        parsed = self.parser.parse(action_text)
        action = parsed.calls[0] if parsed.calls else None
        if action is not None and action.name == "answer":
            self.answer = action.arguments["text"]
            return StepResult(None, 0.0, True, {"action": "answer"})
        if self.turns > self.max_turns:  # the last turn is answer-only: no search, it ends here
            return StepResult(None, 0.0, True, {"action": "final_without_answer"})
        if action is None:
            self.metrics["invalid_actions"] += 1
            self.metrics["tool_errors"] += 1
            return StepResult(CORRECTION, 0.0, False, {"action": "invalid"})
        hits = (await self.client().search([action.arguments["text"]]))[0]
        self.metrics["search_calls"] += 1
        self.metrics["tool_calls"] += 1
        return StepResult(information_block(hits), 0.0, False, {"action": "search", "hits": len(hits)})

    def reward(self, transcript: Transcript) -> float:
        golds = self.task["golden_answers"]
        generated = "".join(
            m["content"] for m in transcript.messages if m["role"] in ("assistant", "observation")
        )
        format_ok = valid_format(generated)
        self.metrics.update(
            answered=int(self.answer is not None),
            em=exact_match(self.answer, golds),
            subem=substring_match(self.answer, golds),
            format_ok=int(format_ok),
        )
        return score_answer(self.answer, golds, self.metric, format_ok, self.format_reward)


class SearchToolEnv(_Retrieval, ToolEnv):
    """The tool-calling variant: `search` is a tool; the final message holds `<answer>…</answer>`."""

    system_prompt = (
        "You answer questions using a search tool over a knowledge corpus. Call `search` whenever "
        "you lack a fact, as many times as you need. When you know the answer, reply with it "
        "inside <answer> and </answer>, e.g. <answer> Beijing </answer>."
    )
    required_task_fields = QA_TASK_FIELDS

    def __init__(
        self,
        retriever_url: str = DEFAULT_URL,
        topk: int = 3,
        metric: str = "em",
        retriever_timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_retrieval(retriever_url, topk, metric, retriever_timeout_s)

    @tool
    async def search(self, query: str) -> str:
        """Search the knowledge corpus and return the best matching documents.

        Args:
            query: What to look up, e.g. "founder of the Xalud Conservatory".
        """
        hits = (await self.client().search([query]))[0]
        return format_passages(hits).strip() or "No documents matched the query."

    def reset(self, task: dict[str, Any]) -> Messages:
        self.task = normalize_task(task)
        self.metrics["data_source"] = self.task["data_source"]
        return self.prompt({"question": self.task["question"]})

    def reward(self, transcript: Transcript) -> float:
        answer = extract_answer(transcript.final_text)
        if answer is None and transcript.finish_reason == "done":
            answer = transcript.final_text.strip()  # a plain final message is the answer
        golds = self.task["golden_answers"]
        self.metrics.update(
            answered=int(answer is not None),
            em=exact_match(answer, golds),
            subem=substring_match(answer, golds),
        )
        return score_answer(answer, golds, self.metric)
