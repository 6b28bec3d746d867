"""On-policy distillation: a teacher's log-probs of the student's own tokens as a dense reward.

The student samples episodes as usual; before its step the learner asks the teacher's servers
(`learner.distill.servers`, started by `agentrl run` as the plan's `teacher` roles) for the
log-prob of every token of each trained sequence (`inference/prompt_logprobs.py`: embedded,
SGLang or vLLM). Each generated token t then gets the per-token reverse-KL estimate

    k_t = log π_student(y_t | y_<t) − log π_teacher(y_t | y_<t)

on the token the student sampled (π_student: the behaviour log-prob the inference server
returned when sampling), and its advantage becomes

    A_t = task_weight · A_task + coef · (−k_t)

a dense per-token reward with no sum over later tokens (discount 0), as in Thinking Machines'
"On-Policy Distillation" (2025) and the GKD family (Agarwal et al., arXiv 2306.13649; on-policy
reverse KL: MiniLLM, arXiv 2306.08543). The policy objective (`loss.policy_loss`, with its
corrections) then trains on A_t as on any advantage, so E[∇] is −coef·∇KL(π ‖ π_teacher) plus the
task's policy gradient. Tokens outside the loss mask (prompt, tool output, user turns) get no
term: their k_t is never computed into an advantage. `task_weight: 0` is pure distillation.

Refused (`check`): `loss.advantage: gae` (GAE replaces the advantages after this runs), a
sampling temperature other than 1 (the teachers' log-probs are at temperature 1) and the
colocated mode (no teacher servers are started there); with `launcher.type: ray` the teacher's
servers must be given (`servers`): only the local launcher starts them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from agentrl.section import Section

if TYPE_CHECKING:  # torch and the HTTP client load when the learner runs, not with the config
    from collections.abc import Callable

    import torch

    from agentrl.config import AgentRLConfig
    from agentrl.learner.packing import MicroBatch

    AllReduce = Callable[[dict[str, float], str], dict[str, float]]


class DistillConfig(Section):
    """On-policy distillation from a served teacher (`learner.distill`); off while `teacher_model`
    and `servers` are both unset."""

    teacher_model: str | None = None
    """Checkpoint of the teacher: `agentrl run` serves it with `num_servers` servers of `backend`.
    null (with `servers` empty): no distillation."""
    backend: Literal["embedded", "sglang", "vllm"] = "embedded"
    """Inference backend that serves the teacher (`agentrl serve --backend`)."""
    servers: list[str] = Field(default_factory=list)
    """URLs of the teacher's servers; `agentrl run` fills them in for the servers it starts. Set by
    hand to use teacher servers that are already running."""
    num_servers: int = Field(1, ge=1)
    """Teacher servers `agentrl run` starts."""
    served_model_name: str | None = None
    """backend: vllm: the model name the teacher's server answers to (null: its only model)."""
    coef: float = Field(1.0, ge=0)
    """Weight of the reverse-KL reward −(log π_student − log π_teacher) in each generated token's advantage."""
    task_weight: float = Field(1.0, ge=0)
    """Weight of the task advantage (from the env's reward) beside it; 0 is pure distillation."""
    timeout_s: float = Field(300.0, gt=0)
    """One request to a teacher server fails after this long (then the next server is tried)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each teacher server asks Ray for (as `inference.resources`)."""

    @property
    def enabled(self) -> bool:
        return self.teacher_model is not None or bool(self.servers)


def check(config: AgentRLConfig) -> None:
    """Refuse settings distillation cannot serve, naming the field to change."""
    d = config.learner.distill
    if not d.enabled:
        return
    if config.learner.loss.advantage == "gae":
        raise ValueError("learner.distill: not with loss.advantage: gae (GAE recomputes the advantages "
                         "after the teacher's reward is added); use an outcome estimator such as grpo")  # fmt: skip
    if config.learner.temperature != 1.0:
        raise ValueError("learner.distill: the teacher's log-probs are at temperature 1; set "
                         "learner.temperature (and roller.temperature) to 1")  # fmt: skip
    if config.mode == "colocated":
        raise ValueError("learner.distill: the colocated mode starts no teacher servers; use mode: decoupled")
    if config.launcher.type == "ray" and not d.servers:
        raise ValueError("learner.distill.servers: launcher.type: ray does not start teacher servers yet; "
                         "start them (agentrl serve --model TEACHER) and give their URLs")  # fmt: skip


def sequences_of(mb: MicroBatch) -> dict[int, torch.Tensor]:
    """Flat positions of each sequence of the micro-batch that has loss tokens (padding has none)."""
    has_loss = mb.mask.new_zeros(mb.num_seqs).index_add(0, mb.seq_idx, mb.mask) > 0
    return {s: (mb.seq_idx == s).nonzero().squeeze(1) for s in range(mb.num_seqs) if bool(has_loss[s])}


def teacher_logp(
    mb: MicroBatch, per_seq: dict[int, list[float]], where: dict[int, torch.Tensor]
) -> torch.Tensor:
    """The teacher's log-probs laid out like `mb.behav_logp`: position p, the j-th of its sequence,
    predicts token j+1, so it gets that token's log-prob; other positions get 0."""
    import torch

    out = torch.zeros_like(mb.behav_logp)
    for s, pos in where.items():
        lp = torch.tensor(per_seq[s], dtype=out.dtype, device=out.device)
        out[pos[:-1]] = lp[1:]
    return out


def distill_advantage(
    adv: torch.Tensor, mask: torch.Tensor, behav_logp: torch.Tensor, teacher: torch.Tensor, coef: float,
    task_weight: float,
) -> torch.Tensor:  # fmt: skip
    """A_t = task_weight·A_t − coef·(log π_student − log π_teacher) on loss tokens; elsewhere
    task_weight·A_t (those positions train nothing: their mask is 0)."""
    return task_weight * adv - coef * (behav_logp - teacher) * mask


async def _score(cfg: DistillConfig, seqs: list[list[int]], first: int) -> list[list[float]]:
    """The sequences' prompt log-probs from the first teacher server that answers, starting at `first`."""
    from agentrl.inference import prompt_logprobs
    from agentrl.inference.base import ServerUnavailableError

    errors = []
    for k in range(len(cfg.servers)):
        url = cfg.servers[(first + k) % len(cfg.servers)]
        try:
            return await prompt_logprobs.fetch_async(cfg.backend, url, seqs, model=cfg.served_model_name,
                                                     timeout_s=cfg.timeout_s)  # fmt: skip
        except ServerUnavailableError as exc:
            errors.append(str(exc))
    raise RuntimeError("learner.distill: no teacher server answered: " + "; ".join(errors))


async def _score_all(cfg: DistillConfig, per_mb: list[list[list[int]]]) -> list[list[list[float]]]:
    return list(await asyncio.gather(*(_score(cfg, seqs, i) for i, seqs in enumerate(per_mb) if seqs)))


def apply(cfg: DistillConfig, mbs: list[MicroBatch], all_reduce: AllReduce) -> dict[str, float]:
    """Query the teacher for every sequence of `mbs` (micro-batches spread over its servers, in
    parallel), store its log-probs in `mb.extra["teacher_logp"]`, fold the reverse-KL reward into
    `mb.adv`; returns the step's `distill/*` metrics, summed over the data-parallel ranks by
    `all_reduce` (the backend's)."""
    if not cfg.servers:
        raise RuntimeError("learner.distill: no teacher servers (agentrl run starts them; or set learner.distill.servers)")  # fmt: skip
    wheres = [sequences_of(mb) for mb in mbs]
    flat_ids = [mb.input_ids.reshape(-1).cpu() for mb in mbs]
    per_mb = [[flat_ids[i][pos].tolist() for pos in w.values()] for i, w in enumerate(wheres)]
    answers = iter(asyncio.run(_score_all(cfg, per_mb)))
    sums = {"tokens": 0.0, "kl": 0.0, "teacher": 0.0, "student": 0.0}
    for mb, where, seqs in zip(mbs, wheres, per_mb, strict=True):
        got = next(answers) if seqs else []
        teacher = teacher_logp(mb, dict(zip(where, got, strict=True)), where)
        mb.extra["teacher_logp"] = teacher
        mb.adv = distill_advantage(mb.adv, mb.mask, mb.behav_logp, teacher, cfg.coef, cfg.task_weight)
        m = mb.mask.bool()
        sums["tokens"] += float(m.sum())
        sums["kl"] += float((mb.behav_logp - teacher)[m].sum())
        sums["teacher"] += float(teacher[m].sum())
        sums["student"] += float(mb.behav_logp[m].sum())
    sums = all_reduce(sums, "sum")
    n = max(sums["tokens"], 1.0)
    return {
        "distill/reverse_kl": sums["kl"] / n,
        "distill/teacher_logp": sums["teacher"] / n,
        "distill/student_logp": sums["student"] / n,
    }
