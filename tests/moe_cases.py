"""The near-tie MoE case the router-replay tests share: a server and a learner checkpoint of the
tiny MoE model that route one token differently.

The server's weights are the tiny MoE model with its experts scaled (random init leaves every
expert's output ~0, so routing would not matter) and its layer-0 router edited so that at the last
prompt token expert `b` (the (k+1)-th) sits `GAP` below expert `a` (the k-th). The learner's are
the same plus 2·`GAP` for `b` along that token's hidden state: a perturbation of ~1e-5 in norm
that makes `b` win, so the argmax routing of that token flips while every log-prob stays close.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GAP = 1e-5  # router-logit margin of the constructed near tie (fp32 noise is ~1e-7)
EXPERT_SCALE = 30.0


def router_input(model, ids: list[int]):
    """The layer-0 router's input hidden states [T, H] on `ids`."""
    import torch

    from agentrl.moe import routers

    seen = {}
    handle = routers(model)[0].register_forward_pre_hook(lambda _m, args: seen.setdefault("h", args[0]))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["h"].reshape(len(ids), -1)


def near_tie(tiny_moe_model: Path, root: Path, prompt: list[int]) -> tuple[Path, Path, tuple[int, int, int]]:
    """(server checkpoint, learner checkpoint, (position, a, b)) under `root`: at the last token of
    `prompt` the server routes to `a` and the learner to `b` in layer 0."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.moe import routers

    server_dir, learner_dir = root / "server", root / "learner"
    shutil.copytree(tiny_moe_model, server_dir)
    shutil.copytree(tiny_moe_model, learner_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_moe_model), dtype=torch.float32)
    router = routers(model)[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(EXPERT_SCALE)
        t = len(prompt) - 1
        x = router_input(model, prompt)[t]
        logits = router.weight @ x
        order = logits.argsort(descending=True).tolist()
        a, b = order[router.top_k - 1], order[router.top_k]
        direction = x / x.dot(x)
        router.weight[b] += (logits[a] - logits[b] - GAP) * direction
        model.save_pretrained(server_dir)
        router.weight[b] += 2 * GAP * direction
        model.save_pretrained(learner_dir)
    return server_dir, learner_dir, (t, a, b)
