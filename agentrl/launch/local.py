"""`agentrl run`: the whole system on one machine, as separate processes.

    agentrl run --config recipes/quickstart.yaml

Start-up order (each step waits for the previous one to be ready):
1. the resolved config is written to the run directory;
2. optionally a supervised warm start (`learner.warmstart.steps > 0`): `agentrl warmstart`
   writes `<run_dir>/warmstart`, which the servers and the learner then load;
3. `inference.num_servers` embedded servers (`agentrl serve`; vLLM ones with `inference.type:
   vllm`, see `inference/vllm_launch.py`) on free loopback ports,
   until each answers `/health`;
4. the learner (`agentrl learner`, under torchrun when `learner.num_processes > 1`), which
   hosts the TransferQueue and pushes weights to the servers;
5. `roller.num_processes` rollers (`agentrl roller`).
Steps 3-5 are a plan (`plan_children`: one `ChildSpec` per process, with its command line
and whether it is restarted) computed before anything starts, then executed. Every child is
told the others' addresses on its command line (the same flags a user passes when starting
them by hand on separate nodes). Children run in their own process groups, and each is sent
SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG on Linux): a `kill -9` of `agentrl run`
leaves no server holding its port or device, and the learner still saves its final checkpoint.

Supervision (`_watch`): a server or roller that dies (exit non-zero, kill -9) is restarted
with the same command line — a server on the same port — after `launcher.restart_backoff_s`,
doubled per restart of that child, at most `launcher.max_restarts` times; each restart is
logged and appended to `<run_dir>/launcher.jsonl` with its reason. A server whose process
lives but that has not answered /health with 200 for `launcher.unhealthy_after_s` (a vLLM
server whose engine died answers 503; a hung one nothing) is named by the health watchdog
(`watchdog.py`, probes off the main loop), logged with what was seen, stopped (`stop_unhealthy`:
SIGTERM to its process group, SIGKILL `KILL_AFTER_S` later) and restarted the same way, the
reason `unhealthy: ...`; out of restarts, the run ends naming it. The learner brings a restarted server to
its version before rollers use it (weight_sync `behind`, the router's version window). Only
the learner's death ends the run (exit 1, naming it); `agentrl run --resume` continues from
its last checkpoint. Shutdown stops every child by PID in reverse order — on completion (the
learner exits 0), on Ctrl-C / SIGTERM, or when a child has used up its restarts. A live view
shows step, version, reward, staleness, episodes/s, queue depth, weight-push time, restarts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from agentrl.config import AgentRLConfig, save_resolved
from agentrl.inference import server_list
from agentrl.inference.registry import backend as inference_backend
from agentrl.launch.control import exit_state, mark_ended
from agentrl.launch.plan import Addresses, Role, plan, render, server_url, service_roles, teacher_roles
from agentrl.launch.procs import Child, ChildSpec, Supervisor, agentrl_command, warm_model
from agentrl.launch.progress import exit_code, watch
from agentrl.launch.servers import LiveServers, LocalScaler
from agentrl.launch.watchdog import KILL_AFTER_S, HealthWatch
from agentrl.log import get_logger
from agentrl.net import free_port, wait_healthy

logger = get_logger(__name__)


def start_services(config: AgentRLConfig, supervisor: Supervisor) -> dict[str, str]:
    """Start the helper processes the env asks for (`Env.services`, the plan's `service_roles`)
    on loopback ports; returns the env kwargs that point every other process at them."""
    kwargs = {}
    for role in service_roles(config):
        port = free_port()
        child = supervisor.start(
            role.name, agentrl_command(*render(role, Addresses([]), ("127.0.0.1", port)))
        )
        try:
            wait_healthy([server_url("127.0.0.1", port)], [child.proc], path=role.health_path)
        except RuntimeError:
            raise RuntimeError(f"{role.name} failed to start:\n{supervisor.tail(child)}") from None
        kwargs[role.kwarg] = role.url("127.0.0.1", port)
    return kwargs


@contextlib.contextmanager
def serve_for(config: AgentRLConfig, model: str | None = None) -> Iterator[AgentRLConfig]:
    """The config with live servers: `inference.servers` as given, or one embedded server started
    here on `model` (default: the config's model); the env's helper services started too. All
    are stopped on exit."""
    supervisor = Supervisor(Path(config.run_dir) / "eval")
    try:
        env_kwargs = {**config.env.kwargs, **start_services(config, supervisor)}
        update: dict = {"env": config.env.model_copy(update={"kwargs": env_kwargs})}
        if not config.inference.servers or model is not None:
            model = model or config.inference.model_path or config.learner.model_path
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = supervisor.start(
                "server", agentrl_command("serve", "--model", model, "--port", str(port))
            )
            wait_healthy([url], [server.proc])
            update["inference"] = config.inference.model_copy(update={"servers": [url], "model_path": model})
            update["roller"] = config.roller.model_copy(update={"tokenizer_path": model})
        yield config.model_copy(update=update)
    finally:
        supervisor.stop_all()


def plan_children(
    config: AgentRLConfig, config_path: Path, model: str, service_overrides: list[str], resume: bool = False
) -> list[ChildSpec]:
    """The shared plan (`launch/plan.py`) on this machine: servers on free loopback ports, the
    learner (torchrun for several ranks), the rollers, each with the flags a user would give it on
    its own node. Servers and rollers are restarted when they die; the learner is not."""
    roles = plan(config, config_path, model, service_overrides, resume)
    ports = [free_port() for r in roles if r.kind == "server"]
    addrs = Addresses([server_url("127.0.0.1", p) for p in ports])
    return [local_spec(role, addrs, ports) for role in roles]


def local_spec(role: Role, addrs: Addresses, ports: list[int]) -> ChildSpec:
    """One role as a child of this machine's Supervisor; server i binds `ports[i]`."""
    if role.kind == "server":
        i = int(role.name.removeprefix("server"))
        args = render(role, addrs, ("127.0.0.1", ports[i]))
        return ChildSpec(role.name, agentrl_command(*args), role.env, True, addrs.servers[i])
    args = render(role, addrs)
    if role.kind == "learner" and role.ranks > 1:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={role.ranks}",
        ]
        return ChildSpec(role.name, [*torchrun, "-m", "agentrl", *args], role.env, role.restart)
    return ChildSpec(role.name, agentrl_command(*args), role.env, role.restart)


def start_teachers(config: AgentRLConfig, config_path: Path, supervisor: Supervisor) -> list[str]:
    """Start the teacher's servers of `learner.distill` (the plan's `teacher_roles`) on loopback
    ports, restarted on the same port when they die; returns the flag that gives the learner their URLs."""
    roles = teacher_roles(config, config_path)
    if not roles:
        return []
    ports = [free_port() for _ in roles]
    urls = [server_url("127.0.0.1", p) for p in ports]
    children = [
        supervisor.run(ChildSpec(role.name, agentrl_command(*render(role, Addresses([]), ("127.0.0.1", port))),
                                 role.env, True, url))
        for role, port, url in zip(roles, ports, urls, strict=True)
    ]  # fmt: skip
    timeout_s = inference_backend(config.learner.distill.backend).startup_timeout_s(config.inference)
    try:
        wait_healthy(urls, [c.proc for c in children], timeout_s=timeout_s)
    except RuntimeError:
        failed = supervisor.failed()
        raise RuntimeError(f"{failed.name} failed to start:\n{supervisor.tail(failed)}") from None
    return ["--learner.distill.servers=[" + ", ".join(urls) + "]"]


def launch(config: AgentRLConfig, config_path: Path, resume: bool = False) -> int:
    """Run the job described by `config` (already validated, saved at `config_path`); with
    `resume` the learner continues from its latest checkpoint and a finished warm start is kept.
    `launcher.type: ray` hands the same plan to the Ray launcher (`launch/ray.py`); `mode: colocated`
    starts ranks that generate and train in turn instead (`launch/colocated.py`; with Ray, the
    plan's one role)."""
    if config.launcher.type == "ray":
        from agentrl.launch.ray import launch_ray

        return launch_ray(config, config_path, resume)
    if config.mode == "colocated":  # no servers, rollers or queue: ranks that generate and train
        from agentrl.launch.colocated import launch as launch_colocated

        return launch_colocated(config, config_path, resume)
    run_dir = Path(config.run_dir)
    supervisor = Supervisor(run_dir)
    secret_env = getattr(config.queue, "secret_env", None)
    if secret_env and not os.environ.get(secret_env):
        # one machine, one job: a fresh shared secret authenticates the queue's messages
        os.environ[secret_env] = secrets.token_hex(32)
    try:
        return exit_code(lambda: _run(config, config_path, supervisor, resume))
    finally:
        supervisor.stop_all()
        mark_ended(run_dir, {c.name: exit_state(c.proc.returncode) for c in supervisor.children})


def _run(config: AgentRLConfig, config_path: Path, supervisor: Supervisor, resume: bool) -> int:
    """Warm start, env services, servers (healthy), the learner and rollers, then the main loop."""
    run_dir = Path(config.run_dir)
    model = config.learner.model_path
    if config.learner.warmstart.steps > 0:
        model = _warm_start(supervisor, run_dir, config_path, resume)
    service_overrides = [f"--env.kwargs.{k}={v}" for k, v in start_services(config, supervisor).items()]
    service_overrides += start_teachers(config, config_path, supervisor)
    specs = plan_children(config, config_path, model, service_overrides, resume)
    servers = _start_servers(config, supervisor, specs)
    live = None
    if servers:  # the learner reads it and the queue carries it on to the rollers, whichever backend
        path = server_list.path_in(run_dir)
        live = LiveServers(
            functools.partial(server_list.write, path), {c.name: c.spec.health_url for c in servers}
        )
        specs = [
            replace(s, env={**s.env, server_list.ENV: str(path.resolve())}) if s.name == "learner" else s
            for s in specs
        ]
    children = [supervisor.run(s) for s in specs if not s.health_url]
    learner = next(c for c in children if c.name == "learner")
    roller_args = next(s.args for s in specs if s.name.startswith("roller"))
    return _watch(config, supervisor, learner, LocalScaler(supervisor, roller_args, live))


def _warm_start(supervisor: Supervisor, run_dir: Path, config_path: Path, resume: bool) -> str:
    """The warm-started model the run starts from: `agentrl warmstart` run to its end, or (with
    `resume`) the one a previous life of the run finished."""
    if (warm_model(run_dir) if resume else None) is None:
        child = supervisor.start(
            "warmstart", agentrl_command("warmstart", "--config", str(config_path)), threads=None
        )
        if child.proc.wait() != 0:
            raise RuntimeError(
                f"warmstart exited with code {child.proc.returncode}:\n{supervisor.tail(child)}"
            )
    return str(run_dir / "warmstart")


def _start_servers(config: AgentRLConfig, supervisor: Supervisor, specs: list[ChildSpec]) -> list[Child]:
    """The children with a health URL (the inference servers), once every one answers it within
    the backend's start-up timeout; a server that exits first fails the run with its log's tail."""
    servers = [supervisor.run(s) for s in specs if s.health_url]
    try:
        timeout_s = inference_backend(config.inference.type).startup_timeout_s(config.inference)
        wait_healthy(
            [s.health_url for s in specs if s.health_url], [c.proc for c in servers], timeout_s=timeout_s
        )
    except RuntimeError:
        failed = supervisor.failed()
        raise RuntimeError(f"{failed.name} failed to start:\n{supervisor.tail(failed)}") from None
    return servers


def supervise(
    supervisor: Supervisor,
    learner: Child,
    max_restarts: int,
    backoff_s: float,
    health: HealthWatch | None = None,
) -> str | None:
    """One round of supervision: stop servers `health` names unhealthy, restart dead (or stopped)
    servers and rollers (with backoff, bounded). Returns "done" when the learner finished, "failed"
    when the run must stop, None to go on."""
    code = learner.proc.poll()
    if code is not None:
        if code == 0:
            return "done"
        _log_exit(supervisor, learner, "its death ends the run (continue it with agentrl run --resume)")
        return "failed"
    now = time.monotonic()
    if health is not None:
        stop_unhealthy(supervisor, health, now)
    for child in supervisor.children:
        code = child.proc.poll()
        if child is learner or code is None or (code == 0 and not child.stopped_why) or child.spec is None:
            continue
        if not child.spec.restart or child.restarts >= max_restarts:
            _log_exit(
                supervisor, child, f"restarted {child.restarts} time(s) already (launcher.max_restarts)"
            )
            return "failed"
        if child.restart_at is None:
            child.restart_at = now + backoff_s * 2**child.restarts
            logger.warning(
                "%s %s; restart %d/%d in %.1fs. Last lines of %s:\n%s", child.name, _ended(child),
                child.restarts + 1, max_restarts, child.restart_at - now, child.log_path, supervisor.tail(child),
            )  # fmt: skip
        elif now >= child.restart_at:
            why = child.stopped_why or f"exit code {code}"
            supervisor.restart(child)
            logger.warning("restarted %s (pid %d), restart %d/%d", child.name, child.proc.pid,
                           child.restarts, max_restarts)  # fmt: skip
            record = {"time": time.time(), "child": child.name, "exit_code": code, "why": why,
                      "restart": child.restarts}  # fmt: skip
            with (supervisor.run_dir / "launcher.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
    return None


def stop_unhealthy(supervisor: Supervisor, health: HealthWatch, now: float) -> None:
    """Stop the running servers (children with a health URL) that `health` names: SIGTERM (and
    SIGCONT: a stopped process cannot act on it) to the process group, SIGKILL `KILL_AFTER_S`
    later if it still runs. Each then exits, and `supervise` restarts it or ends the run."""
    running = {
        c.name: c for c in supervisor.children if c.spec and c.spec.health_url and c.proc.poll() is None
    }
    for name, why in health.check({n: (c.spec.health_url, c.proc.pid) for n, c in running.items()}).items():
        child = running[name]
        logger.error("%s (pid %d) is %s; stopping it to restart it. Last lines of %s:\n%s", name,
                     child.proc.pid, why, child.log_path, supervisor.tail(child))  # fmt: skip
        child.stopped_why, child.kill_at = why, now + KILL_AFTER_S
        supervisor.signal(child, signal.SIGTERM, signal.SIGCONT)
    for child in running.values():
        if child.kill_at is not None and now >= child.kill_at:
            logger.warning("%s did not stop in %.0fs: SIGKILL", child.name, KILL_AFTER_S)
            supervisor.signal(child, signal.SIGKILL)
            child.kill_at = None


def _ended(child: Child) -> str:
    if child.stopped_why:
        return f"was stopped by the launcher ({child.stopped_why}), exit code {child.proc.returncode}"
    return f"exited with code {child.proc.returncode}"


def _log_exit(supervisor: Supervisor, child: Child, why: str) -> None:
    logger.error("%s %s; %s; stopping the run. Last lines of %s:\n%s", child.name, _ended(child), why,
                 child.log_path, supervisor.tail(child))  # fmt: skip


def _watch(config: AgentRLConfig, supervisor: Supervisor, learner: Child, scaler: LocalScaler) -> int:
    """Show live progress, supervise (the servers' health watched, `watchdog.py`) and apply
    `agentrl scale` until the learner finishes or the run must stop; the state `agentrl status`
    shows is rewritten each round."""
    launcher = config.launcher
    startup_s = max(
        inference_backend(name).startup_timeout_s(config.inference)
        for name in (config.inference.type, config.learner.distill.backend)
    )
    health = HealthWatch(launcher.unhealthy_after_s, startup_s)
    try:
        return watch(
            config,
            "local",
            lambda: (
                scaler.tick()
                or supervise(supervisor, learner, launcher.max_restarts, launcher.restart_backoff_s, health)
            ),
            scaler.apply,
            scaler.processes,
            lambda: sum(c.restarts for c in supervisor.children),
        )
    finally:
        health.close()


def run(config: AgentRLConfig, resume: bool = False) -> int:
    config_path = save_resolved(config)

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the children like Ctrl-C: no orphans

    signal.signal(signal.SIGTERM, _terminate)
    return launch(config, config_path, resume)
