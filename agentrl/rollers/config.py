"""The roller's config section (`roller:`): episode sampling, limits and the task source.

Kept beside the roller code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it. Imports nothing of the rollers themselves.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from agentrl.section import Section


class RollerConfig(Section):
    """A roller: episode sampling, limits and the task source."""

    tasks: str = "builtin"
    """Task source: a JSONL or Parquet file of task objects, or `builtin` for the env's own generator."""
    task_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Options of the env's built-in task generator (e.g. `{digits: 2}` for the toy calculator)."""
    tokenizer_path: str | None = None
    """Tokenizer of the served model (defaults to the model the inference servers load)."""
    max_groups: int | None = Field(None, ge=1)
    """Stop after putting this many groups (None: run until stopped)."""
    group_size: int = Field(8, ge=1)
    """Episodes sampled per prompt; they form one group (GRPO's n)."""
    max_concurrent_episodes: int = Field(64, ge=1)
    """Episodes run at once by one roller process."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode before it is ended with reason `max_turns`."""
    max_new_tokens: int = Field(128, ge=1)
    """New tokens per assistant turn."""
    max_total_tokens: int = Field(1024, ge=16)
    """Context budget of a whole episode (prompt plus all turns)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (log-probs are those of the tempered distribution)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock limit of one episode."""
    drop_uniform_reward_groups: bool = False
    """Dynamic sampling: drop groups whose episodes all have the same reward (counted)."""
    drop_overlong: bool = False
    """Overlong filtering: mask out episodes that ended by running out of context."""
    greedy_baseline: bool = False
    """ReMax: each group also runs one greedy episode (temperature 0, top-k 1) of its task, not trained
    on; its reward travels as the group's `metrics["greedy_reward"]`, the baseline of `remax`."""
    log_every_s: float = Field(10.0, gt=0)
    """Seconds between progress lines and metrics records."""
    num_processes: int = Field(1, ge=1)
    """Roller processes `agentrl run` starts."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each roller asks Ray for, e.g. `{CPU: 16, sandbox: 1}` (`CPU`, `GPU`
    and custom resources of `ray start --resources`)."""
    max_consecutive_failures: int = Field(50, ge=0)
    """Stop (exit non-zero) after this many groups in a row failed (server lost, env error); 0: never."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    """On stop, how long in-flight groups may take to finish and be put before they are abandoned."""
    seed: int = 0
    """Random seed of task order and sampling seeds."""
    index: int | None = Field(None, ge=0)
    """This roller's number among the run's rollers (default: `$AGENTRL_ROLLER_INDEX`, which
    `agentrl run` sets, else 0). It names the roller's queue lease and its metrics and group files;
    which tasks it runs comes from the queue's shared task cursor, not from the index."""
