"""`agentrl doctor`: what this machine offers and whether a config's model is usable.

Prints versions, devices, which optional backends (Ray, Redis, Docker, NIXL, SGLang,
vLLM, sandboxes) are present, then loads the config's model and tokenizer with the
same `from_pretrained` calls training uses, renders a tool-calling conversation
through the chat template and runs one forward pass. Everything printed is measured
on the spot; nothing is assumed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shutil
import time
from pathlib import Path

from agentrl.config import AgentRLConfig

OPTIONAL_PACKAGES = {
    "ray": "ray",
    "redis": "redis",
    "docker": "docker",
    "nixl": "nixl",
    "bm25s": "search",
    "mcp": "mcp",
}
"""Inference backends report themselves (their descriptor's `doctor`, agentrl/inference/backends.py)."""
OPTIONAL_BINARIES = ["redis-server", "dockerd", "bwrap", "unshare"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _example_conversation() -> tuple[list[dict], list[dict]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. 3 + 4"}},
                    "required": ["expression"],
                },
            },
        }
    ]
    messages = [
        {"role": "user", "content": "What is 17 + 25?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "17 + 25"}},
                }
            ],
        },
        {"role": "tool", "content": "42"},
    ]
    return messages, tools


def check_model(model_path: str) -> list[tuple[str, str]]:
    """Load tokenizer and model as training does; render and score a tool conversation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows: list[tuple[str, str]] = []
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    rows.append(
        (
            "model",
            f"{model.config.model_type}, {model.num_parameters() / 1e6:.2f}M parameters, "
            f"loaded in {time.perf_counter() - start:.2f}s",
        )
    )
    messages, tools = _example_conversation()
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    rows.append(
        (
            "chat template",
            f"tool conversation renders to {len(text)} chars, {len(ids)} tokens; "
            f"decode round-trip {'exact' if tokenizer.decode(ids) == text else 'DIFFERS'}",
        )
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).mean().item()
    rows.append(("forward pass", f"mean log-prob of the conversation under the current weights: {logp:.3f}"))
    return rows


def backend_rows(config: AgentRLConfig) -> list[tuple[str, str]]:
    """One row per registered inference backend that has a doctor check (built-in or installed)."""
    from agentrl.inference.registry import BACKENDS, backend

    rows = []
    for name in BACKENDS.names():
        try:
            check = backend(name).doctor
        except ValueError as exc:  # an installed plugin that does not load
            rows.append((name, str(exc)))
            continue
        if check is not None:
            rows.append((name, check(config.inference)))
    return rows


def run_doctor(config: AgentRLConfig) -> int:
    """Print the report; return 0 if the config's model is usable, 1 otherwise."""
    import torch
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console()
    table = Table(title="agentrl doctor", show_header=False)
    table.add_row("python", platform.python_version())
    table.add_row("torch", f"{torch.__version__}; cuda devices: {torch.cuda.device_count()}")
    table.add_row("transformers", _version("transformers") or "missing")
    for module, extra in OPTIONAL_PACKAGES.items():
        found = importlib.util.find_spec(module) is not None
        hint = escape(f"absent (pip install agentrl[{extra}])")
        table.add_row(module, (_version(module) or "present") if found else hint)
    for name, row in backend_rows(config):
        table.add_row(name, escape(row))
    for binary in OPTIONAL_BINARIES:
        table.add_row(binary, shutil.which(binary) or "absent")

    model_path = config.learner.model_path
    status = 0
    try:
        for name, value in check_model(model_path):
            table.add_row(name, value)
    except (OSError, ValueError) as exc:
        hint = (
            "" if Path(model_path).exists() else f" (create one with `agentrl init-model tiny {model_path}`)"
        )
        table.add_row("model", f"cannot load {model_path}: {str(exc).splitlines()[0]}{hint}")
        status = 1
    console.print(table)
    return status
