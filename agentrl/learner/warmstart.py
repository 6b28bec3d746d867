"""`agentrl warmstart`: a short supervised start on the env's own demonstrations.

    agentrl warmstart --config recipes/quickstart.yaml    # writes <run_dir>/warmstart

A randomly initialised model never produces a well-formed tool call, so RL from scratch
has no reward to learn from. The warm start trains next-token prediction on the assistant
turns of `Env.demonstrate(task)` conversations, laid out token for token as the agent loop
lays out episodes (so the model learns the exact format it will be sampled in), for
`learner.warmstart.steps` steps, then saves a Hugging Face checkpoint that the inference
servers and the learner load. One process; meant for small models and short runs.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger

log = get_logger("learner.warmstart")


def demonstration_batch(config: AgentRLConfig, num: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`num` (ids, mask) demonstrations from the env's task generator."""
    from transformers import AutoTokenizer

    from agentrl.envs.registry import env_factory, load_env_class
    from agentrl.rollers.chat import ChatRenderer, render_conversation

    make_env = env_factory(config.env)
    env = make_env()
    tokenizer = AutoTokenizer.from_pretrained(config.learner.model_path)
    renderer = ChatRenderer(tokenizer, env.tool_schemas or None)
    tasks = load_env_class(config.env.name).generate_tasks(num, seed=seed, **config.roller.task_kwargs)
    return [render_conversation(renderer, make_env().demonstrate(task)) for task in tasks]


def _loss(model: torch.nn.Module, batch: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    mask = torch.zeros((len(batch), width))
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, seq_mask) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = torch.tensor(seq_mask, dtype=torch.float)
        attention[row, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    target_mask = mask[:, 1:]
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1)


def warmstart(config: AgentRLConfig) -> Path:
    from transformers import AutoModelForCausalLM

    from agentrl.learner.fsdp import copy_tokenizer

    lc = config.learner
    torch.manual_seed(lc.seed)
    out = Path(config.run_dir) / "warmstart"
    model = AutoModelForCausalLM.from_pretrained(lc.model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lc.warmstart.lr)
    pad_id = model.config.pad_token_id or 0
    pool = demonstration_batch(config, max(256, lc.warmstart.batch_size * 8), seed=lc.seed + 7919)
    rng = random.Random(lc.seed)
    metrics = MetricsLogger(config.run_dir, "warmstart")
    for step in range(1, lc.warmstart.steps + 1):
        loss = _loss(model, rng.sample(pool, lc.warmstart.batch_size), pad_id)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lc.optim.max_grad_norm)
        optimizer.step()
        metrics.log({"warmstart/loss": loss.item()}, step)
        if step % 20 == 0 or step == lc.warmstart.steps:
            log.info("warm start step %d/%d  loss %.4f", step, lc.warmstart.steps, loss.item())
    metrics.close()
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(Path(lc.model_path), out)
    log.info("warm-started model written to %s", out)
    return out
