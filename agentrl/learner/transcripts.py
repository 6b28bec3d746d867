"""Transcripts you can read: a sample of the episodes the learner trains on, as text.

The learner receives every group with its exact tokens, so it is the one writer per run: every
`learner.logging.transcripts_every` steps (and at the first step) rank 0 decodes a few episodes
of the batch with the model's tokenizer and appends them to `<run_dir>/transcripts.jsonl`, one
object per episode:

    step, group_id, prompt_id, episode (index in its group), reward, finish_reason, num_turns,
    num_tokens, num_generated, versions ([oldest, newest] weight version of generated tokens,
    or null), metrics (the env's episode metrics: tool calls, errors, ...), tokens (the ids),
    turns: [{source: prompt | model | env, text, start, end}]

A turn is a run of tokens with one loss-mask value: `prompt` (the rendered prompt, up to the
first generated token), `model` (what the policy generated: its text and tool calls), `env`
(what the env appended: tool results, observations, the chat template's turn markers);
`text` is `tokens[start:end]` decoded, so the turns concatenated are the episode's text. The
same text goes to TensorBoard / W&B when those sinks are on.

`RewardWatch` counts the steps in a row on which every group's rewards were all equal (GRPO
has nothing to learn from them) into the `reward/flat_steps` metric the live view shows, and
warns in the log, naming the transcripts, once the count reaches `logging.flat_reward_steps`.
`agentrl show transcripts RUN_DIR` renders the file (`render`).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.log import MetricsLogger, get_logger
from agentrl.types import Episode, Group

log = get_logger("learner.transcripts")

FILE = "transcripts.jsonl"
KEYS = ("step", "group_id", "prompt_id", "episode", "reward", "finish_reason", "num_turns", "num_tokens",
        "num_generated", "versions", "metrics", "tokens", "turns")  # fmt: skip


def turn_spans(loss_mask: np.ndarray) -> list[tuple[str, int, int]]:
    """(source, start, end) of each run of equal loss-mask values: the first unmasked run is the
    prompt, later ones what the env appended; masked runs are the model's."""
    mask = np.asarray(loss_mask).astype(bool)
    if not len(mask):
        return []
    cuts = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), len(mask)]
    spans = []
    for start, end in itertools.pairwise(cuts):
        source = "model" if mask[start] else ("prompt" if start == 0 else "env")
        spans.append((source, start, end))
    return spans


def episode_record(tokenizer: Any, step: int, group: Group, index: int) -> dict[str, Any]:
    """One episode of `group` as a transcript record (the schema above)."""
    ep: Episode = group.episodes[index]
    tokens = ep.tokens.tolist()
    generated = ep.versions[ep.loss_mask.astype(bool)]
    turns = [
        {"source": source, "text": tokenizer.decode(tokens[start:end], skip_special_tokens=False),
         "start": start, "end": end}
        for source, start, end in turn_spans(ep.loss_mask)
    ]  # fmt: skip
    return {
        "step": step,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "episode": index,
        "reward": ep.reward,
        "finish_reason": ep.finish_reason,
        "num_turns": ep.num_turns,
        "num_tokens": ep.num_tokens,
        "num_generated": ep.num_generated,
        "versions": [int(generated.min()), int(generated.max())] if generated.size else None,
        "metrics": ep.metrics,
        "tokens": tokens,
        "turns": turns,
    }


def sample(groups: list[Group], k: int, seed: int) -> list[tuple[Group, int]]:
    """Up to `k` episodes of the batch: the lowest and the highest reward, the rest at random."""
    pool = [(g, i) for g in groups for i in range(len(g.episodes))]
    if len(pool) <= k:
        return pool
    by_reward = sorted(pool, key=lambda gi: gi[0].episodes[gi[1]].reward)
    picked = [by_reward[0], by_reward[-1]][:k]
    rest = [gi for gi in pool if not any(gi is p for p in picked)]
    picked += random.Random(seed).sample(rest, k - len(picked))
    return picked


def as_text(record: dict[str, Any]) -> str:
    """A record as plain text (for the TensorBoard and W&B sinks)."""
    head = (f"step {record['step']}  reward {record['reward']:.3g}  finish {record['finish_reason']}  "
            f"turns {record['num_turns']}  tokens {record['num_tokens']} ({record['num_generated']} generated)")  # fmt: skip
    body = "".join(f"\n--- {t['source']} ---\n{t['text']}" for t in record["turns"])
    return head + body


class TranscriptWriter:
    """Rank 0's writer of `<run_dir>/transcripts.jsonl` (the tokenizer is loaded at the first write)."""

    def __init__(self, run_dir: Path, model_path: str, every: int, episodes: int) -> None:
        self.path = Path(run_dir) / FILE
        self.model_path, self.every, self.episodes = model_path, every, episodes
        self._tokenizer = None
        self._last: int | None = None

    def due(self, step: int) -> bool:
        """At the first step written, then every `every` steps (once per step: skipped steps keep it)."""
        if not self.every or not self.episodes or step == self._last:
            return False
        return self._last is None or step % self.every == 0

    def write(self, step: int, groups: list[Group], metrics: MetricsLogger | None = None) -> list[dict]:
        """Decode a sample of `groups` and append it; the sinks get the same text."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        records = [
            episode_record(self._tokenizer, step, g, i) for g, i in sample(groups, self.episodes, step)
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        self._last = step
        if metrics is not None and records:
            metrics.log_text({f"transcripts/{n}": as_text(r) for n, r in enumerate(records)}, step)
        return records


class RewardWatch:
    """Steps in a row whose groups all had equal rewards; a log warning at `limit` (and every
    `limit` steps after) naming the transcripts."""

    def __init__(self, run_dir: Path, limit: int) -> None:
        self.path, self.limit, self.flat = Path(run_dir) / FILE, limit, 0

    def observe(self, step: int, groups: list[Group]) -> int:
        if groups and all(np.ptp(g.rewards) == 0 for g in groups if g.episodes):
            self.flat += 1
        else:
            self.flat = 0
        if self.limit and self.flat and self.flat % self.limit == 0:
            rewards = sorted({float(r) for g in groups for r in g.rewards})
            log.warning("rewards within every group were equal (%s) for %d steps in a row: no advantage, "
                        "nothing to learn from; read what the model writes with `agentrl show transcripts %s` "
                        "(%s)", ", ".join(f"{r:g}" for r in rewards[:5]), self.flat, self.path.parent, self.path)  # fmt: skip
        return self.flat


class StepNotes:
    """The loop's hook (rank 0, step 6): the flat-reward count into the step's metrics, and a
    transcript sample when one is due."""

    def __init__(self, run_dir: Path, model_path: str, logging_cfg: Any) -> None:
        self.writer = TranscriptWriter(run_dir, model_path, logging_cfg.transcripts_every,
                                       logging_cfg.transcripts_episodes)  # fmt: skip
        self.watch = RewardWatch(run_dir, logging_cfg.flat_reward_steps)

    def step(
        self, step: int, groups: list[Group], m: dict[str, float], metrics: MetricsLogger | None
    ) -> None:
        m["reward/flat_steps"] = float(self.watch.observe(step, groups))
        if self.writer.due(step):
            try:
                self.writer.write(step, groups, metrics)
            except Exception:  # a transcript never stops training
                log.exception("could not write transcripts at step %d", step)


# --------------------------------------------------------------------------- reading


def read_transcripts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/transcripts.jsonl` (a missing file says where it looked)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        raise FileNotFoundError(
            f"no transcripts at {path}: the learner writes them every learner.logging.transcripts_every steps"
        )
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def select(
    records: list[dict], step: int | None = None, order: str | None = None, limit: int = 4
) -> list[dict]:
    """The records of `step` (default: the last step written), `order` `worst` / `best` by reward
    (over all steps when no step is given), at most `limit`."""
    if step is None and order is None and records:
        step = records[-1]["step"]
    chosen = [r for r in records if step is None or r["step"] == step]
    if order is not None:
        chosen = sorted(chosen, key=lambda r: r["reward"], reverse=order == "best")
    return chosen[:limit]


STYLE = {"prompt": "dim", "model": "bold green", "env": "cyan"}


def render(records: list[dict], console: Any) -> None:
    """Each record as a rich panel: a header line, then its turns coloured by source."""
    from rich.panel import Panel
    from rich.text import Text

    for r in records:
        body = Text()
        for turn in r["turns"]:
            body.append(f"[{turn['source']}]\n", style="bold")
            body.append(turn["text"] + "\n", style=STYLE.get(turn["source"], ""))
        keys = {k: v for k, v in (r.get("metrics") or {}).items() if k.startswith("tool")}
        title = (f"step {r['step']}  reward {r['reward']:.3g}  finish {r['finish_reason'] or '-'}  "
                 f"turns {r['num_turns']}  tokens {r['num_tokens']} ({r['num_generated']} generated)  "
                 f"versions {r['versions']}")  # fmt: skip
        sub = "  ".join(f"{k} {v}" for k, v in keys.items()) or None
        console.print(Panel(body, title=title, subtitle=sub, title_align="left"))
