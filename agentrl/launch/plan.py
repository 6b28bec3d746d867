"""What `agentrl run` starts, as data: one plan shared by the local and the Ray launcher.

A `Role` is one process of the run (an env service, an inference server, the learner with its
ranks, a roller) with its `agentrl` command line *without the addresses*, the resources it asks a
scheduler for, and whether it is restarted when it dies. `render` fills the addresses in once they are known:
the local launcher knows them before anything starts (free loopback ports, `local_addresses`);
the Ray launcher learns them at run time, as each actor reports the host:port it bound on its
node. Both then give every process the same flags a user passes when starting it by hand.

Start order, for both launchers: the env's services (`service_roles`; until each answers its
health path, and every other process is then given its URL as an `env.kwargs` flag), the
teacher's servers of on-policy distillation (`teacher_roles`, local launcher only; their URLs
become `learner.distill.servers`), servers
(until each answers /health), the learner (it hosts the TransferQueue at `Addresses.queue` and
pushes weights to the servers), the rollers. What each role asks a scheduler for is its section's
`resources` (`inference`, `learner` per rank, `roller`, `env.service_resources`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.config import AgentRLConfig

Kind = Literal["service", "server", "learner", "roller"]


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
    services: dict[str, str] = field(default_factory=dict)  # env kwarg -> URL of a service that moved


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
    if config.mode == "colocated":  # one role: the ranks that generate and train in turn
        args = ["colocated", *common, *(["--resume"] if resume else [])]
        return [
            Role(
                "learner",
                "learner",
                args,
                dict(config.learner.resources),
                ranks=config.colocated.num_processes,
            )
        ]
    # the backend's own launcher (inference/registry.py) behind `agentrl serve`; embedded is its default
    backend = ["--backend", config.inference.type] if config.inference.type != "embedded" else []
    servers = [
        Role(
            f"server{i}",
            "server",
            ["serve", *backend, *common],
            dict(config.inference.resources),
            restart=True,
        )
        for i in range(config.inference.num_servers)
    ]
    learner = Role(
        "learner",
        "learner",
        ["learner", *common, *(["--resume"] if resume else [])],
        dict(config.learner.resources),
        ranks=config.learner.num_processes,
    )
    rollers = [roller_role(config, common, i) for i in range(config.roller.num_processes)]
    return [*servers, learner, *rollers]


def teacher_roles(config: AgentRLConfig, config_path: Path) -> list[Role]:
    """The teacher's servers of on-policy distillation (`learner.distill`): `agentrl serve` of
    `teacher_model` with the distill section's backend, restarted when they die like the rollout
    servers, but never sent weights (the learner only reads their prompt log-probs). None when
    distillation is off or its `servers` are given."""
    d = config.learner.distill
    if d.teacher_model is None or d.servers:
        return []
    backend = ["--backend", d.backend] if d.backend != "embedded" else []
    args = ["serve", *backend, "--config", str(config_path), "--model", d.teacher_model]
    return [
        Role(f"teacher{i}", "server", args, dict(d.resources), restart=True) for i in range(d.num_servers)
    ]


def roller_role(config: AgentRLConfig, common: list[str], index: int) -> Role:
    """Roller `index` (its queue lease, metrics and group files are named after it)."""
    resources = dict(config.roller.resources)
    return Role(
        f"roller{index}", "roller", ["roller", *common], resources, True, {"AGENTRL_ROLLER_INDEX": str(index)}
    )


@dataclass
class ServiceRole(Role):
    """An env's helper process (`Env.services`); `args` hold `{port}` where its port goes."""

    kwarg: str = ""  # the env kwarg the others are given its URL in
    url_path: str = ""
    health_path: str = "/health"

    def url(self, host: str, port: int) -> str:
        return server_url(host, port) + self.url_path

    def override(self, host: str, port: int) -> str:
        """The flag that points every other process at this service."""
        return f"--env.kwargs.{self.kwarg}={self.url(host, port)}"


def service_roles(config: AgentRLConfig) -> list[ServiceRole]:
    """The env's helper services for this config, restarted when they die, each asking for
    `env.service_resources`."""
    from agentrl.envs.registry import load_env_class

    env_cls = load_env_class(config.env.name)
    services = env_cls.services(dict(config.env.kwargs), dict(config.roller.task_kwargs), config.run_dir)
    return [
        ServiceRole(s.name, "service", list(s.args), dict(config.env.service_resources), restart=True,
                    kwarg=s.kwarg, url_path=s.url_path, health_path=s.health_path)
        for s in services
    ]  # fmt: skip


def render(role: Role, addrs: Addresses, bind: tuple[str, int] | None = None) -> list[str]:
    """The role's `agentrl` arguments with the addresses filled in; a server or service binds `bind`."""
    args = list(role.args)
    if role.kind == "service":
        assert bind is not None, "a service is rendered with the host:port it binds"
        args = [a.replace("{port}", str(bind[1])) for a in args]
        return args if "--host" in args else [*args, "--host", bind[0]]
    if role.kind == "server":
        assert bind is not None, "a server is rendered with the host:port it binds"
        return [args[0], "--host", bind[0], "--port", str(bind[1]), *args[1:]]
    args += ["--inference.servers", "[" + ", ".join(addrs.servers) + "]"]
    if addrs.queue is not None:
        args.append(f"--queue.address={addrs.queue}")
    if role.kind == "learner" and addrs.master_address is not None:
        args.append(f"--weight_sync.master_address={addrs.master_address}")
    # after the plan's flags, so these win: a service back on another node, where it is now
    args += [f"--env.kwargs.{kwarg}={url}" for kwarg, url in addrs.services.items()]
    return args


def server_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"
