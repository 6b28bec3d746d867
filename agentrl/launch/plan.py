"""What `agentrl run` starts, as data: one plan shared by the local and the Ray launcher.

A `Role` is one process of the run (an inference server, the learner with its ranks, a roller)
with its `agentrl` command line *without the addresses*, the resources it asks a scheduler for,
and whether it is restarted when it dies. `render` fills the addresses in once they are known:
the local launcher knows them before anything starts (free loopback ports, `local_addresses`);
the Ray launcher learns them at run time, as each actor reports the host:port it bound on its
node. Both then give every process the same flags a user passes when starting it by hand.

Start order, for both launchers: servers (until each answers /health), the learner (it hosts
the TransferQueue at `Addresses.queue` and pushes weights to the servers), the rollers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.config import AgentRLConfig

Kind = Literal["server", "learner", "roller"]


@dataclass
class Role:
    """One process of the plan, before its addresses are known."""

    name: str
    kind: Kind
    args: list[str]  # `agentrl` subcommand and flags, addresses left out
    resources: dict[str, float] = field(default_factory=dict)
    restart: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ranks: int = 1  # the learner's torch.distributed ranks (one process each)


@dataclass
class Addresses:
    """Where the run's processes are reached; what `render` writes into command lines."""

    servers: list[str]  # http://host:port of each server slot
    queue: str | None = None  # tcp://host:port the learner binds (None: the config's queue.address)
    master_address: str | None = None  # weight-sync rendezvous host (None: the config's)


def plan(
    config: AgentRLConfig, config_path: Path, model: str, overrides: list[str], resume: bool = False
) -> list[Role]:
    """Servers, then the learner, then the rollers. `overrides` are more flags for every process
    (e.g. the env services' addresses). Servers and rollers are restarted, the learner is not."""
    common = [
        "--config",
        str(config_path),
        f"--learner.model_path={model}",
        f"--inference.model_path={model}",
    ]
    common += overrides
    res = config.launcher.resources
    backend = ["--backend", "vllm"] if config.inference.type == "vllm" else []  # inference/vllm_launch.py
    servers = [
        Role(f"server{i}", "server", ["serve", *backend, *common], dict(res.get("server", {})), restart=True)
        for i in range(config.inference.num_servers)
    ]
    learner = Role(
        "learner",
        "learner",
        ["learner", *common, *(["--resume"] if resume else [])],
        dict(res.get("learner", {})),
        ranks=config.learner.num_processes,
    )
    rollers = [roller_role(config, common, i) for i in range(config.roller.num_processes)]
    return [*servers, learner, *rollers]


def roller_role(config: AgentRLConfig, common: list[str], index: int) -> Role:
    """Roller `index` (its queue lease, metrics and group files are named after it)."""
    resources = dict(config.launcher.resources.get("roller", {}))
    return Role(
        f"roller{index}", "roller", ["roller", *common], resources, True, {"AGENTRL_ROLLER_INDEX": str(index)}
    )


def render(role: Role, addrs: Addresses, bind: tuple[str, int] | None = None) -> list[str]:
    """The role's `agentrl` arguments with the addresses filled in; a server binds `bind`."""
    args = list(role.args)
    if role.kind == "server":
        assert bind is not None, "a server is rendered with the host:port it binds"
        return [args[0], "--host", bind[0], "--port", str(bind[1]), *args[1:]]
    args += ["--inference.servers", "[" + ", ".join(addrs.servers) + "]"]
    if addrs.queue is not None:
        args.append(f"--queue.address={addrs.queue}")
    if role.kind == "learner" and addrs.master_address is not None:
        args.append(f"--weight_sync.master_address={addrs.master_address}")
    return args


def server_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"
