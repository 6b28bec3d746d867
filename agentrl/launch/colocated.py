"""`agentrl run` for `mode: colocated` on this machine (`launcher.type: local`): the warm start,
then `colocated.num_processes` ranks. (`launcher.type: ray` places the same ranks in one
placement group instead: `launch/plan.py`, `launch/ray.py`.)

Both are child processes of `agentrl run`: the warm start is `agentrl warmstart` (as the
decoupled launcher runs it; it writes `<run_dir>/warmstart`), the ranks are torchrun processes
on this machine (`torch.distributed.run --standalone`, gloo on CPU, NCCL on GPUs) running
`agentrl colocated` (`agentrl.colocated.loop`); there are no servers, rollers or queue to start. The run ends when the
ranks do; Ctrl-C or SIGTERM to `agentrl run` is passed on to the running child (torchrun
forwards it to the ranks), which gets `STOP_GRACE_S` before it is killed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrl.config import AgentRLConfig
from agentrl.log import get_logger

log = get_logger("launch.colocated")

STOP_GRACE_S = 30.0


def launch(config: AgentRLConfig, config_path: Path, resume: bool = False) -> int:
    """The warm start (kept from an earlier attempt with `resume`), then the ranks (`--resume`:
    from the newest intact checkpoint)."""
    from agentrl.launch.procs import warm_model

    model = config.learner.model_path
    warm = warm_model(Path(config.run_dir)) if resume and config.learner.warmstart.steps > 0 else None
    if warm is not None:
        model = str(warm)
    elif config.learner.warmstart.steps > 0:
        code = _run([sys.executable, "-m", "agentrl", "warmstart", "--config", str(config_path)])
        if code != 0:
            log.error("colocated: the warm start exited with %d", code)
            return code
        model = str(Path(config.run_dir) / "warmstart")
    n = config.colocated.num_processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "agentrl", "colocated", "--config", str(config_path),
           f"--learner.model_path={model}"] + (["--resume"] if resume else [])  # fmt: skip
    log.info("colocated: %d ranks: %s", n, " ".join(cmd))
    return _run(cmd)


def _run(cmd: list[str]) -> int:
    """Run `cmd` to its end; SIGINT / SIGTERM to this process stop it (SIGTERM, then SIGKILL
    after `STOP_GRACE_S`)."""
    proc = subprocess.Popen(cmd)
    stop_at: list[float] = []

    def stop(_signum: int, _frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic())
            proc.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if stop_at and time.monotonic() - stop_at[0] > STOP_GRACE_S:
                    log.warning(
                        "colocated: pid %d did not stop within %.0f s; killing it", proc.pid, STOP_GRACE_S
                    )
                    proc.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
