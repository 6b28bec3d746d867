"""`agentrl run` for `mode: colocated`: the warm start, then `colocated.num_processes` ranks.

The ranks are torchrun processes on this machine (`torch.distributed.run --standalone`, gloo on
CPU, NCCL on GPUs) running `agentrl.colocated.loop`; there are no servers, rollers or queue to
start. The run ends when the ranks do; Ctrl-C / SIGTERM stops them (torchrun forwards it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentrl.config import AgentRLConfig
from agentrl.log import get_logger

log = get_logger("colocated.launch")


def launch(config: AgentRLConfig, config_path: Path) -> int:
    model = config.learner.model_path
    if config.learner.warmstart.steps > 0:
        from agentrl.learner.warmstart import warmstart

        model = str(warmstart(config))
    n = config.colocated.num_processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "agentrl.colocated.loop", "--config", str(config_path),
           f"--learner.model_path={model}"]  # fmt: skip
    log.info("colocated: %d ranks: %s", n, " ".join(cmd))
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
