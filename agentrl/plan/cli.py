"""`agentrl plan`: rank deployments of a cluster for a model and workload, and write the best as a config.

    agentrl plan --model path/to/config.json --gpus 64 --device h100 [--workload w.yaml] [--out run.yaml]
    agentrl plan --model 7b --gpus 16 ...      # a size instead of a config: a Qwen2.5-shaped model

    agentrl plan calibrate --model runs/models/mini --out profile.json   # this machine, measured

Predictions come from the analytic profile of the device (`agentrl/plan/profile.py`, which names
the published figures it uses); `agentrl plan calibrate` measures this machine's profile
(`agentrl/plan/calibrate.py`), which `agentrl bench plan` checks against real runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from agentrl.plan.profile import DEVICES, ModelShape
from agentrl.plan.search import Hardware, rank, to_config
from agentrl.plan.workload import Workload

GIB = 1024**3

# Qwen2.5 shapes, for `--model SIZE` when no config is at hand (values of their published config.json)
SIZES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064),
    "14b": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=13824, vocab_size=152064),
    "32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=27648, vocab_size=152064),
    "72b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=29568, vocab_size=152064),
}  # fmt: skip


def load_model(spec: str) -> tuple[ModelShape, str]:
    """A HF `config.json` (or the directory holding it) or a size from `SIZES`; and the model path
    the written config names."""
    if spec.lower() in SIZES:
        return ModelShape.from_hf_config(SIZES[spec.lower()]), f"Qwen/Qwen2.5-{spec.upper()}-Instruct"
    path = Path(spec)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(
            f"--model {spec}: neither a config.json (or its directory) nor one of {', '.join(SIZES)}"
        )
    return ModelShape.from_hf_config(json.loads(file.read_text())), str(file.parent)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="HF config.json (or its directory), or a size: " + ", ".join(SIZES)
    )
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device", choices=sorted(DEVICES), default="h100")
    p.add_argument("--workload", type=Path, help="YAML of agentrl.plan.workload.Workload fields")
    p.add_argument("--k", type=int, nargs="*", default=[0, 1, 2], help="max_staleness values to consider")
    p.add_argument("--roller-concurrency", type=int, default=256, help="episodes one roller runs at once")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the best deployment as an `agentrl run` config")
    return p


def main(args: list[str]) -> int:
    if args and args[0] == "calibrate":
        from agentrl.plan.calibrate import main as calibrate

        return calibrate(args[1:])
    opts = _parser().parse_args(args)
    model, model_path = load_model(opts.model)
    workload = (
        Workload.from_dict(yaml.safe_load(opts.workload.read_text()) or {}) if opts.workload else Workload()
    )
    hw = Hardware(DEVICES[opts.device], opts.gpus, opts.gpus_per_node)
    ranked = rank(model, hw, workload, tuple(opts.k), opts.roller_concurrency, top=opts.top)
    if not ranked:
        print(f"no deployment of a {model.params / 1e9:.1f}B model fits {opts.gpus} × {hw.device.name}")
        return 1
    print(f"{model.params / 1e9:.2f}B parameters on {opts.gpus} × {hw.device.name}; {hw.device.source}")
    print(f"{'#':>2}  {'samples/s':>9}  {'step s':>7}  {'server busy':>11}  {'learner busy':>12}  "
          f"{'learner GiB':>11}  {'server GiB':>10}  {'push s':>6}  deployment")  # fmt: skip
    for i, r in enumerate(ranked, 1):
        print(
            f"{i:>2}  {r.result.samples_per_s:>9.2f}  {r.result.step_time_s:>7.1f}  {r.result.server_busy:>11.0%}  "
            f"{r.result.learner_busy:>12.0%}  {r.learner_memory / GIB:>11.1f}  {r.server_memory / GIB:>10.1f}  "
            f"{r.push_s:>6.2f}  {r.candidate.describe()}"
        )
    if opts.out:
        opts.out.write_text(
            yaml.safe_dump(to_config(ranked[0].candidate, workload, model_path), sort_keys=False)
        )
        print(f"wrote {opts.out} (check it: agentrl config show --config {opts.out})")
    return 0
