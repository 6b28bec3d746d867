"""One rank of a 2-rank tensor-parallel engine replica, for tests/integration/test_colocated_tp.py.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/integration/colocated_tp_worker.py MODEL_DIR OUT_DIR

Both ranks build the TP engine on an uninitialised module filled from the full weights. Rank 0
(the replica's leader) schedules and samples, rank 1 replays (`Engine.follow`). What rank 0
records in OUT_DIR/rank0.json: the TP forward's logits on a fixed prompt against the unsharded
model's, generated log-probs against a fresh forward, and two LookupEnv episodes run by the
roller's agent loop, first against the embedded HTTP server (unsharded) and then against the TP
replica, each episode under the same torch seed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.colocated.client import EngineClient
from agentrl.colocated.lockstep import Lockstep
from agentrl.config import RollerConfig
from agentrl.envs.toy import LookupEnv
from agentrl.hybrid.tp import empty_model
from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams
from agentrl.inference.sglang import SGLangClient
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer

PROMPT = [3, 17, 250, 41, 9, 77, 512, 6]
EPISODE_SEED = 1234


def _generate(engine: Engine) -> list[dict]:
    """Two greedy rows and one sampled row, decoded together by the replica."""
    done, event = [], threading.Event()

    def on_done(req: Request) -> None:
        done.append(req)
        if len(done) == 3:
            event.set()

    torch.manual_seed(5)
    for i, temp in enumerate((0.0, 0.0, 1.0)):
        params = SamplingParams(max_new_tokens=8 + 3 * i, temperature=temp, ignore_eos=True)
        engine.submit(Request(f"g{i}", PROMPT[: 4 + 2 * i], params, on_done))
    assert event.wait(120), "replica generation did not finish"
    return [{"input_ids": r.input_ids, "output_ids": r.output_ids, "logprobs": r.logprobs} for r in done]


class EagerLookup(LookupEnv):
    """LookupEnv whose turns also end at common letters: a random model rarely writes a closing
    tag, and a turn cut by length ends the episode; so every turn reaches `env.step`, which
    answers with its tool-protocol observation, and the episode has several turns."""

    stop = ("e", "a", "o", "</lookup>", "</answer>")


async def _episodes(client, renderer: ChatRenderer) -> list[dict]:
    config = RollerConfig(max_turns=3, max_new_tokens=12, max_total_tokens=220, temperature=1.0)
    out = []
    for i, task in enumerate(LookupEnv.generate_tasks(2, seed=0)):
        torch.manual_seed(EPISODE_SEED + i)
        ep = await run_episode(EagerLookup(), task, client, renderer, config)
        out.append({"tokens": ep.tokens.tolist(), "mask": ep.loss_mask.tolist(), "logprobs": ep.logprobs.tolist(),
                    "versions": ep.versions.tolist(), "turns": ep.num_turns, "reward": ep.reward})  # fmt: skip
    return out


def main(model_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    lock = Lockstep(list(range(world)), dist.new_group(backend="gloo"))
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    module = empty_model(ref.config, torch.device("cpu"), torch.float32, mesh)
    engine = Engine(model_path, model=module, replica=lock, cpu_threads=1)
    engine.load_weights(dict(ref.named_parameters()), None)
    result: dict = {
        "rank": rank,
        "local_q_rows": int(module.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]),
    }

    # 1. the TP forward (a collective: every rank) against the unsharded model
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        result["logits_max_diff"] = float(
            (module(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max()
        )

    # 2. the replica decodes: the leader schedules and samples, the follower replays
    if lock.is_leader:
        engine.start()
        result["generated"] = _generate(engine)
        engine.end_phase()
    else:
        result["follower_steps"] = engine.follow()

    # 3. the same episodes on the decoupled embedded server (rank 0 only) and on the TP replica
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    renderer = ChatRenderer(tokenizer, LookupEnv().tool_schemas or None)
    if lock.is_leader:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.unit.inference.conftest import ServerThread

        server = ServerThread(Path(model_path)).start()

        async def over_http() -> list[dict]:
            async with SGLangClient(server.url) as client:
                return await _episodes(client, renderer)

        result["episodes_http"] = asyncio.run(over_http())
        server.stop()
        result["episodes_tp"] = asyncio.run(_episodes(EngineClient(engine), renderer))
        engine.end_phase()
        engine.stop()
    else:
        result["follower_steps_episodes"] = engine.follow()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
