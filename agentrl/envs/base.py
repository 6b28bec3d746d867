"""The environment API: one `Env` instance per episode, plain Python, sync or async.

    class MyEnv(Env):
        required_task_fields = ("question", "answer")   # checked for every task at start-up
        def reset(self, task):            # -> the prompt: chat messages (or raw text)
            return [{"role": "user", "content": task["question"]}]
        def step(self, action_text):      # -> (observation, reward, done, info)
            return None, 0.0, True, {}
        def reward(self, transcript):     # -> float, once per episode; may be async
            return float(task["answer"] in transcript.final_text)

An observation is a list of chat messages to append (rendered by the model's chat
template, e.g. `{"role": "tool", "content": ...}`), a raw string appended verbatim
(continuation protocols such as Search-R1's `<information>` blocks), or None. Any
method may be a coroutine. `tools` (rendered into the prompt through the chat
template's `tools=`) and `stop` (extra stop strings for generation) are class or
instance attributes; `required_task_fields` (a class attribute) names the task fields the env
reads, so a task file that lacks one is refused at start-up instead of failing mid-run.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, NamedTuple

from agentrl.log import get_logger

logger = get_logger(__name__)

Messages = list[dict[str, Any]]
Observation = Messages | str | None


class StepResult(NamedTuple):
    """What `Env.step` returns; a plain 4-tuple works too."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] | None = None


@dataclass
class Transcript:
    """An ended episode as the reward function sees it."""

    task: dict[str, Any]
    messages: Messages
    final_text: str  # the last assistant turn's text
    num_turns: int
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)


async def resolve(value: Any) -> Any:
    """Await `value` if it is awaitable: lets env methods be sync or async."""
    return await value if inspect.isawaitable(value) else value


class Env:
    """Base class of every environment. Subclasses override what they need."""

    tools: Sequence[Any] = ()
    """Tools rendered into the prompt (see ToolEnv); empty for tool-less envs."""
    stop: Sequence[str] = ()
    """Extra stop strings for generation (e.g. `</search>`)."""
    required_task_fields: Sequence[str | tuple[str, ...]] = ()
    """Fields every task must carry (present and not null) for this env; a tuple names
    alternatives, one of which suffices. The roller checks every task of a task file against
    them at start-up and names the file, line and missing field (`missing_task_fields`)."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(kwargs)}")
        self.metrics: dict[str, Any] = {}

    def reset(self, task: dict[str, Any]) -> Messages | str:
        raise NotImplementedError(f"{type(self).__name__}.reset(task) must return the prompt")

    def step(self, action_text: str) -> StepResult | tuple:
        return StepResult(None, 0.0, True, {})

    def reward(self, transcript: Transcript) -> float:
        return 0.0

    def close(self) -> None:
        """Release what the episode held (sandboxes, connections)."""

    def demonstrate(self, task: dict[str, Any]) -> Messages:
        """An ideal conversation for `task` (prompt, assistant turns, env turns), for the
        supervised warm start. Envs that can solve their own tasks implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} has no demonstrations: set learner.warmstart.steps: 0"
        )

    @classmethod
    def services(cls, kwargs: dict[str, Any], task_kwargs: dict[str, Any], run_dir: str) -> list[Service]:
        """Helper processes `agentrl run` should start for these env kwargs (none by default)."""
        return []

    @classmethod
    def task_env(cls, kwargs: dict[str, Any]) -> type[Env] | None:
        """The env whose tasks (generator, required fields) this env runs with these kwargs; None:
        its own. An agent env names another (`env.kwargs.tasks_from`)."""
        return None

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
        """Synthetic tasks for envs that can make their own (used when no task file is given)."""
        raise NotImplementedError(f"{cls.__name__} has no task generator: give the roller a task file")

    @classmethod
    def missing_task_fields(cls, task: dict[str, Any]) -> list[str]:
        """The `required_task_fields` that `task` lacks, alternatives joined by " or "."""
        missing = []
        for required in cls.required_task_fields:
            names = (required,) if isinstance(required, str) else tuple(required)
            if all(task.get(name) is None for name in names):
                missing.append(" or ".join(repr(name) for name in names))
        return missing

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools]


@dataclass
class Service:
    """A helper process `agentrl run` starts for an env (e.g. a retriever) before the rollers.

    `args` are `agentrl` arguments where `{port}` is replaced by a free port; once `health_path`
    answers, env kwarg `kwarg` is set to `http://<host>:{port}{url_path}` for every process. If
    the service comes back elsewhere (Ray restarted it on another node), the rollers hear its new
    URL through the queue (`live_services`)."""

    name: str
    args: list[str]
    kwarg: str
    url_path: str = ""
    health_path: str = "/health"


class LiveServices:
    """Where this process's env services are now: env kwarg -> URL, as the launcher's live map
    says (`inference.server_list`; a roller's queue producer calls `update` with each epoch it
    is carried). `env_factory` builds each new env with these URLs over `env.kwargs`, and a
    client that resolves its URL per request (`url`, e.g. the retriever client) follows a move
    even in the middle of an episode. Empty (every URL as configured) outside a launched run."""

    def __init__(self) -> None:
        self.epoch = 0
        self.urls: dict[str, str] = {}

    def update(self, epoch: int, urls: dict[str, str]) -> None:
        if epoch <= self.epoch:
            return
        moved = {k: v for k, v in urls.items() if self.urls.get(k) != v}
        first, self.epoch, self.urls = not self.urls, epoch, dict(urls)
        for kwarg, url in moved.items():  # the first map names where they started: no move
            logger.log(INFO if first else WARNING, "env service %s is at %s (epoch %d)", kwarg, url, epoch)

    def url(self, kwarg: str, given: str) -> str:
        """The current URL of the service env kwarg `kwarg` points at; `given` if none moved."""
        return self.urls.get(kwarg, given)

    def kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` with the current URL of each service kwarg it names."""
        return {k: self.urls.get(k, v) if isinstance(v, str) else v for k, v in kwargs.items()}


live_services = LiveServices()
"""This process's map (one roller per process, one run)."""


def as_step_result(value: Any) -> StepResult:
    """Accept a StepResult or a (observation, reward, done[, info]) tuple from user code."""
    if isinstance(value, StepResult):
        return value if value.info is not None else value._replace(info={})
    if isinstance(value, tuple) and len(value) in (3, 4):
        observation, reward, done, *info = value
        return StepResult(observation, float(reward), bool(done), info[0] if info else {})
    raise TypeError(f"Env.step must return (observation, reward, done, info), got {type(value).__name__}")
