"""Typed configuration: one pydantic model per component, loaded from presets.

A run is described by `AgentRLConfig`, whose sections (`learner`, `roller`, `queue`,
`inference`, `weight_sync`, `env`) are each handed only to the component that owns
them. Presets are YAML or TOML files (see `recipes/`); dotted command-line overrides
(`--learner.optim.lr 1e-6`) are applied on top. Every model forbids unknown keys and every
field carries a docstring, which doubles as CLI help and as the reference in
`docs/config.md`. Validation happens before any process starts; the error names the
field to change and what it accepts.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agentrl.learner.distill import check as check_distill
from agentrl.log import get_logger
from agentrl.rewards.config import RewardConfig
from agentrl.section import Section

log = get_logger("config")


class ConfigError(ValueError):
    """A preset or override that does not describe a valid run."""


# --------------------------------------------------------------------------- learner
# `learner:` and its sub-sections live in agentrl/learner/config.py; they are re-exported here.

from agentrl.learner.config import (  # noqa: E402
    MOVED,
    CheckpointConfig,
    CriticConfig,
    LearnerConfig,
    LoggingConfig,
    LossConfig,
    OptimConfig,
    ScheduleConfig,
    WarmstartConfig,
)

__all__ = [
    "MOVED", "AgentRLConfig", "CheckpointConfig", "ConfigError", "CriticConfig", "LearnerConfig",
    "LoggingConfig", "LossConfig", "OptimConfig", "ScheduleConfig", "Section", "WarmstartConfig",
    "describe", "load_config", "save_resolved",
]  # fmt: skip


# --------------------------------------------------------------------------- roller


class RollerConfig(Section):
    """A roller: episode sampling, limits and the task source."""

    tasks: str = "builtin"
    """Task source: a JSONL or Parquet file of task objects, or `builtin` for the env's own generator."""
    task_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Options of the env's built-in task generator (e.g. `{digits: 2}` for the toy calculator)."""
    tokenizer_path: str | None = None
    """Tokenizer of the served model (defaults to the model the inference servers load)."""
    max_groups: int | None = Field(None, ge=1)
    """Stop after putting this many groups (None: run until stopped)."""
    group_size: int = Field(8, ge=1)
    """Episodes sampled per prompt; they form one group (GRPO's n)."""
    max_concurrent_episodes: int = Field(64, ge=1)
    """Episodes run at once by one roller process."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode before it is ended with reason `max_turns`."""
    max_new_tokens: int = Field(128, ge=1)
    """New tokens per assistant turn."""
    max_total_tokens: int = Field(1024, ge=16)
    """Context budget of a whole episode (prompt plus all turns)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (log-probs are those of the tempered distribution)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock limit of one episode."""
    drop_uniform_reward_groups: bool = False
    """Dynamic sampling: drop groups whose episodes all have the same reward (counted)."""
    drop_overlong: bool = False
    """Overlong filtering: mask out episodes that ended by running out of context."""
    greedy_baseline: bool = False
    """ReMax: each group also runs one greedy episode (temperature 0, top-k 1) of its task, not trained
    on; its reward travels as the group's `metrics["greedy_reward"]`, the baseline of `remax`."""
    log_every_s: float = Field(10.0, gt=0)
    """Seconds between progress lines and metrics records."""
    num_processes: int = Field(1, ge=1)
    """Roller processes `agentrl run` starts."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each roller asks Ray for, e.g. `{CPU: 16, sandbox: 1}` (`CPU`, `GPU`
    and custom resources of `ray start --resources`)."""
    max_consecutive_failures: int = Field(50, ge=0)
    """Stop (exit non-zero) after this many groups in a row failed (server lost, env error); 0: never."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    """On stop, how long in-flight groups may take to finish and be put before they are abandoned."""
    seed: int = 0
    """Random seed of task order and sampling seeds."""
    index: int | None = Field(None, ge=0)
    """This roller's number among the run's rollers (default: `$AGENTRL_ROLLER_INDEX`, which
    `agentrl run` sets, else 0). It names the roller's queue lease and its metrics and group files;
    which tasks it runs comes from the queue's shared task cursor, not from the index."""


# --------------------------------------------------------------------------- queue


class ZmqQueueConfig(Section):
    """The TransferQueue over ZeroMQ, hosted by the learner or by `agentrl queue`."""

    type: Literal["zmq"] = "zmq"
    address: str = "tcp://127.0.0.1:5555"
    """Where the queue server binds (a hosting learner) and where producers (and, with
    `standalone`, the learner) connect."""
    capacity_groups: int = Field(1024, ge=1)
    """Groups held before producers are made to wait."""
    capacity_bytes: int = Field(1 << 30, ge=1 << 16)
    """Bytes held before producers are made to wait."""
    max_message_bytes: int = Field(256 << 20, ge=1 << 12)
    """Largest group accepted on the wire; larger ones are refused and counted."""
    durable: bool = False
    """Write each accepted group to a write-ahead log before acknowledging it, so a restarted queue
    (or the hosted queue of a resumed learner) delivers it. Off: the groups the queue held when it
    died (kill -9 of the learner hosting it) are lost, counted as `lost_undurable` (ledger, metric,
    WARNING at the next start), and rollers regenerate them."""
    wal_dir: str | None = None
    """Directory of the write-ahead log (defaults to `<run_dir>/queue_wal` when durable)."""
    selection: Literal["fifo", "oldest_first"] = "fifo"
    """Order in which admissible groups are handed to the learner."""
    wal_fsync: bool = False
    """Also fsync the write-ahead log before acknowledging (survives a machine crash, not only
    a crash of the queue process); costs one fsync per batch of puts. Without it, groups a machine
    crash cuts from the log's tail are counted as `lost_undurable` and named at the next start."""
    auth: Literal["mac", "none"] = "mac"
    """`mac`: every message carries a MAC under the shared secret in `secret_env`; messages that
    fail it are refused and counted. `none`: no authentication (trusted networks only)."""
    secret_env: str = "AGENTRL_QUEUE_SECRET"
    """Environment variable holding the shared secret that authenticates every message."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a learner rank may hold groups without acking before they are handed out again."""
    producer_window_bytes: int = Field(256 << 20, ge=1 << 16)
    """Bytes one producer may have sent and not yet acknowledged (bounds what a full server
    holds back on top of its capacity)."""
    nixl: bool = False
    """Move array payloads over NIXL (RDMA/UCX) with ZeroMQ as the control plane."""
    standalone: bool = False
    """The queue runs on its own (`agentrl queue --bind ...`) at `address`: the learner connects to
    it as a consumer instead of hosting (binding) one, so a durable queue outlives the learner."""
    run_id: str | None = None
    """The run this queue serves; producers and consumers naming another run are refused. None: a
    hosted queue takes the learner's run id (kept in `<run_dir>/run_id` across `--resume`), a
    standalone one its WAL's (durable) or a fresh one; clients adopt the first run id they hear."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between a producer's heartbeats, which renew its lease and detect a restarted server."""
    roller_lease_s: float = Field(10.0, gt=0)
    """Seconds without a message after which a producer's lease lapses: the queue takes back the
    admission credits of the groups it started and had not put (counted `admission_reclaimed`)."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """A client that has heard nothing from the queue for this long after starting gives up with
    an error naming the address, the secret and the run to check."""
    silent_timeout_s: float = Field(120.0, gt=0)
    """A producer whose queue has gone silent for this long (learner gone for good) gives up; keep
    it above the time a learner takes to restart with `--resume`."""

    @model_validator(mode="after")
    def _check_timeouts(self) -> ZmqQueueConfig:
        if self.roller_lease_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"queue.roller_lease_s: must be at least 2 x queue.heartbeat_s ({2 * self.heartbeat_s}s); "
                "a lease shorter than two heartbeats lapses on one late message"
            )
        if self.standalone and any(h in self.address for h in ("*", "0.0.0.0", "[::]")):
            raise ValueError(
                f"queue.address: {self.address!r} is a bind address; with queue.standalone the learner "
                "connects to the standalone queue, so give its host (e.g. tcp://queue-host:5555)"
            )
        return self


class RedisQueueConfig(Section):
    """The TransferQueue over Redis Streams, for teams that already run Redis."""

    type: Literal["redis"] = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    """Redis server URL."""
    stream: str = "agentrl:groups"
    """Stream key the groups are appended to."""
    consumer_group: str = "learner"
    """Redis consumer group of the learner ranks."""
    capacity_groups: int = Field(1024, ge=1)
    """Pending groups before producers are made to wait."""
    selection: Literal["fifo", "oldest_first"] = "fifo"
    """Order in which admissible groups are handed to the learner."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a learner rank may hold groups without acking before another rank claims them."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between a producer's heartbeats, which renew its lease on its admission credits."""
    roller_lease_s: float = Field(10.0, gt=0)
    """Seconds without a heartbeat after which a producer's admission credits are reclaimed
    (`admission_reclaimed`) and its lease is refused (it starts a fresh one)."""


QueueConfig = Annotated[ZmqQueueConfig | RedisQueueConfig, Field(discriminator="type")]


# --------------------------------------------------------------------------- inference


class VLLMLaunchConfig(Section):
    """How `agentrl serve --backend vllm` (and `agentrl run` with `inference.type: vllm`) starts vLLM."""

    python: str | None = None
    """Python of the environment vLLM is installed in; null: `.venv-vllm/bin/python` (`make vllm`)."""
    enforce_eager: bool = True
    """Pass `--enforce-eager`: no torch.compile / graph capture (~35 s to healthy on CPU instead of ~175 s)."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """CPU only: `VLLM_CPU_KVCACHE_SPACE` in GiB; null sizes it from this machine's available memory."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """GPU only: fraction of GPU memory vLLM may take (weights + KV cache)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM server; the weight group then takes that many ranks per server."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Seconds to wait for a started vLLM server to answer `/health`."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line flags for `vllm.entrypoints.openai.api_server`, passed as given."""


class InferenceConfig(Section):
    """Inference servers the rollers generate with and the weight sync updates."""

    type: str = "embedded"
    """Server kind: agentrl's embedded server, SGLang (native API), vLLM (OpenAI API), or a backend
    another package registers (entry-point group `agentrl.inference_backends`)."""

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        from agentrl.inference.registry import BACKENDS

        return BACKENDS.require(value)

    logprobs: Literal["full", "truncated"] = "full"
    """Which distribution the behaviour log-probs are of. "full": log_softmax(logits / temperature)
    over the whole vocabulary, before top-k/top-p (SGLang 0.5.23's default, srt/layers/sampler.py;
    what the learner recomputes). "truncated": the top-k/top-p-restricted, renormalised distribution
    the tokens are drawn from (embedded server; vLLM's processed log-probs); the learner cannot
    recompute it, so it needs roller.top_p: 1 and roller.top_k: -1. Truncation order: the embedded
    server (as SGLang) keeps a token when it is among the top_k most likely and the tempered mass
    strictly above it is at most top_p, both on the full distribution; vLLM 0.32 applies min_p, then
    top_k, then top_p on the top-k-renormalised distribution (`apply_top_k_top_p`), and has no mode
    that reports full tempered log-probs, so with inference.type: vllm top_p / top_k are refused."""
    servers: list[str] = Field(default_factory=list)
    """URLs of running servers; empty means `agentrl run` starts `num_servers` embedded ones."""
    num_servers: int = Field(1, ge=1)
    """Servers (embedded or vLLM) that `agentrl run` starts when `servers` is empty."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each server `agentrl run` starts asks Ray for, e.g. `{GPU: 1, CPU: 4}`."""
    model_path: str | None = None
    """Checkpoint the embedded servers load; defaults to `learner.model_path`."""
    device: str = "cpu"
    """Device of an embedded server: cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of an embedded server."""
    max_batch_size: int = Field(32, ge=1)
    """Requests decoded together by an embedded server."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one generation request before it is retried elsewhere."""
    api_key_env: str = "AGENTRL_API_KEY"
    """Environment variable holding the servers' API key (unset: no key)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Timeout of opening a connection to a server (a dead server fails fast, then failover)."""
    max_retries: int = Field(2, ge=0)
    """Times the router retries a failed request on another server before counting it lost."""
    health_check_interval_s: float = Field(5.0, gt=0)
    """Seconds between the router's health checks of each server."""
    server_wait_s: float = Field(120.0, ge=0)
    """How long a roller's request waits for a usable server (up, and at a weight version inside the
    admissible window) when none is, e.g. while the only server restarts, before it is counted lost."""
    context_length: int | None = Field(None, ge=16)
    """Longest prompt + output an embedded server accepts; defaults to the model's max positions."""
    served_model_name: str | None = None
    """`model` field sent to vLLM's OpenAI API; null sends none (vLLM then uses its only model)."""
    cpu_threads: int | None = Field(1, ge=1)
    """torch threads of an embedded server on CPU (process-wide). 1 suits the small models served on
    CPU next to other processes (more threads thrash on a busy machine); null keeps torch's default."""
    vllm: VLLMLaunchConfig = VLLMLaunchConfig()
    """How vLLM servers are started when agentrl starts them (`inference.type: vllm` without `servers`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings of a backend another package registers, checked by its descriptor's `options` model
    (a backend without one takes none)."""

    @model_validator(mode="after")
    def _backend_options(self) -> InferenceConfig:
        from agentrl.inference.registry import backend

        model = backend(self.type).options
        if model is None and self.options:
            raise ValueError(
                f"inference.options: the {self.type} backend takes no options (got {sorted(self.options)})"
            )
        if model is not None:
            try:
                model.model_validate(self.options)
            except ValidationError as exc:
                raise ValueError(f"inference.options for the {self.type} backend: {exc}") from None
        return self


class LauncherConfig(Section):
    """How `agentrl run` supervises its children."""

    max_restarts: int = Field(3, ge=0)
    """Restarts of one roller or server child after it dies, before the run stops; the learner is
    never restarted (its death ends the run; `agentrl run --resume` continues it)."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Wait before a child's first restart; doubled for each further restart of that child."""
    type: Literal["local", "ray"] = "local"
    """`local`: every process on this machine; `ray`: placed by Ray on a running cluster."""
    address: str = "auto"
    """Ray only: the cluster to join (`auto`: the one `ray start` runs on this node, or HOST:PORT)."""
    forward_env: list[str] = Field(default_factory=lambda: ["HF_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY"])
    """Ray only: environment variables (API keys) handed to every process by an actor method call,
    with the queue's secret; never on a command line or in the actors' runtime_env."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_resources(cls, data: Any) -> Any:
        """`launcher.resources` moved to the sections of the processes that ask for them."""
        if isinstance(data, dict) and "resources" in data:
            raise ValueError(
                "moved keys: launcher.resources is now learner.resources (per rank), inference.resources "
                "(per server), roller.resources (per roller) and env.service_resources (per env service)"
            )
        return data


# --------------------------------------------------------------------------- weight sync


class BroadcastSyncConfig(Section):
    """Bucketed broadcast over a dedicated process group (NCCL on GPUs, gloo on CPU)."""

    type: Literal["broadcast"] = "broadcast"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend; auto picks nccl on CUDA, gloo otherwise."""
    bucket_mb: float = Field(256, gt=0)
    """Size of one broadcast bucket in MiB; peak extra memory is about two buckets."""
    master_address: str = "127.0.0.1"
    """Address of learner rank 0 as the inference servers reach it."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the weight-sync rendezvous; 0 picks a free one."""
    timeout_s: float = Field(120.0, gt=0)
    """Timeout of group set-up and of every collective."""
    workers_per_server: int = Field(1, ge=1)
    """Ranks each inference server contributes to the group (its tensor-parallel size; 1 for embedded)."""
    transactional: Literal["all", "any"] = "any"
    """`any`: each server commits the version or is dropped from the push (re-synced later);
    `all`: every live server commits it or, once one refuses it twice, none does (all stay on the
    previous version). Holds for servers that stage updates (embedded, vLLM); an SGLang server
    loads buckets as they arrive and is kept paused after an aborted push until re-synced."""


class DiskSyncConfig(Section):
    """Fallback: safetensors in a shared directory plus `/update_weights_from_disk`."""

    type: Literal["disk"] = "disk"
    directory: str | None = None
    """Shared directory the learner writes to (defaults to `<run_dir>/weights`)."""
    keep_last: int = Field(2, ge=1)
    """Weight versions kept on disk."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of one server's load."""


WeightSyncConfig = Annotated[BroadcastSyncConfig | DiskSyncConfig, Field(discriminator="type")]


# --------------------------------------------------------------------------- sandbox

IsolationLevel = Literal["none", "rlimits", "namespaces", "bwrap"]


class _SandboxLimits(Section):
    """Limits every sandbox backend enforces on the code it runs."""

    timeout_s: float = Field(60.0, gt=0)
    """Default wall-clock limit of one `exec`; the whole process tree is killed when it passes."""
    memory_mb: int = Field(1024, ge=16)
    """Memory limit of the sandbox (all its processes together where cgroups or Docker allow)."""
    max_processes: int = Field(64, ge=1)
    """Processes/threads the sandbox may run at once (contains fork bombs)."""
    max_output_bytes: int = Field(65536, ge=256)
    """stdout and stderr of one `exec` are each cut to this size (head and tail kept, marker between)."""
    max_file_size_mb: int = Field(256, ge=1)
    """Largest file a sandboxed process may write (RLIMIT_FSIZE); also the most read_file returns."""
    disk_mb: int = Field(1024, ge=0)
    """Disk quota of the sandbox: all it writes together (local: its work and tmp dirs, on a
    filesystem of this size mounted when started as root; docker: the container's writable layer
    where the storage driver supports a size). Writes past it fail with ENOSPC. 0: no quota."""
    workdir: str = "/work"
    """Working directory inside the sandbox; relative paths of read_file/write_file start here."""


class LocalSandboxConfig(_SandboxLimits):
    """Processes on this machine, isolated with bubblewrap or Linux namespaces plus rlimits/cgroups."""

    type: Literal["local"] = "local"
    isolation: Literal["auto", "none", "rlimits", "namespaces", "bwrap"] = "auto"
    """Isolation to use: `auto` takes the strongest available (bwrap > namespaces > rlimits)."""
    min_isolation: IsolationLevel = "bwrap"
    """Weakest isolation accepted: starting a sandbox with less fails (untrusted code never runs)."""
    cpu_time_s: int = Field(120, ge=1)
    """CPU seconds each process may use (RLIMIT_CPU)."""
    ro_paths: list[str] = Field(default_factory=list)
    """Extra host paths bound read-only at the same place (e.g. a Python prefix outside /usr)."""
    python_packages: list[str] = Field(default_factory=list)
    """Pure-Python packages of agentrl's own interpreter made importable inside (e.g. [pytest])."""
    root_dir: str | None = None
    """Host directory the sandboxes' working directories are created in (default: the system temp dir)."""
    uid: int | None = Field(None, ge=1)
    """When started as root: the unprivileged uid sandboxed code runs as (default: a random high uid)."""
    seccomp: bool = True
    """Under bubblewrap, load a seccomp filter refusing new namespaces, mounts and other kernel-wide
    calls to the code inside (`envs/sandbox/seccomp.py`)."""


class DockerSandboxConfig(_SandboxLimits):
    """One Docker container per sandbox, network disabled, removed on close."""

    type: Literal["docker"] = "docker"
    image: str = "agentrl/python-sandbox:latest"
    """Default image when `start()` is not given one (a task's own image wins)."""
    cpus: float = Field(1.0, gt=0)
    """CPUs the container may use (Docker's nano_cpus)."""
    docker_host: str | None = None
    """Docker engine URL, e.g. unix:///var/run/docker.sock; default: DOCKER_HOST or the local socket."""


class RemoteSandboxConfig(Section):
    """A sandbox hosted by `agentrl sandbox-server` on another machine, reached over HTTP.
    Limits and isolation are the server's own (its `--backend` config); it reports them."""

    type: Literal["remote"] = "remote"
    url: str = "http://127.0.0.1:8765"
    """Base URL of the sandbox server."""
    api_key_env: str = "AGENTRL_SANDBOX_KEY"
    """Environment variable holding the API key the server expects."""
    timeout_s: float = Field(60.0, gt=0)
    """Default wall-clock limit of one `exec` (the server caps it at its own limit)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Time to wait for the server to answer before the call fails."""


class PluginSandboxConfig(Section):
    """A sandbox backend another package registers (entry-point group `agentrl.sandboxes`); its
    class gets this section, `options` as given."""

    type: str = "plugin"
    """The name the package registers."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings of that backend, passed to it as given."""

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        from agentrl.envs.sandbox import SANDBOXES

        return SANDBOXES.require(value)


_BUILTIN_SANDBOXES = ("local", "docker", "remote")


def _sandbox_tag(value: Any) -> str:
    """The built-in's own section for its `type`, `plugin` for any other name."""
    kind = value.get("type", "local") if isinstance(value, dict) else getattr(value, "type", "local")
    return kind if kind in _BUILTIN_SANDBOXES else "plugin"


SandboxConfig = Annotated[
    Annotated[LocalSandboxConfig, Tag("local")]
    | Annotated[DockerSandboxConfig, Tag("docker")]
    | Annotated[RemoteSandboxConfig, Tag("remote")]
    | Annotated[PluginSandboxConfig, Tag("plugin")],
    Discriminator(_sandbox_tag),
]


# --------------------------------------------------------------------------- env


class EnvConfig(Section):
    """The environment episodes run in."""

    name: str = "toy_calculator"
    """Built-in env name or a dotted path `package.module:ClassName`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the env's constructor."""
    tool_parser: Literal["hermes", "tags"] = "hermes"
    """How tool calls are parsed: Hermes/Qwen `<tool_call>` JSON or plain tags."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Time one tool call may take before it becomes an error observation."""
    max_tool_output_chars: int = Field(4096, ge=64)
    """Tool output beyond this is truncated with a marker."""
    sandbox: SandboxConfig = LocalSandboxConfig()
    """Where model-written code runs (SWE and other code envs): local, docker, remote, or a backend
    another package registers (entry-point group `agentrl.sandboxes`)."""
    service_resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each helper service of the env (`Env.services`: the Search-R1
    retriever with `retriever_url: auto`) asks Ray for, e.g. `{CPU: 4}` or `{sandbox: 1}`."""

    @model_validator(mode="before")
    @classmethod
    def _default_sandbox_type(cls, data: Any) -> Any:
        """A sandbox section without `type` keeps the local backend."""
        if isinstance(data, dict) and isinstance(data.get("sandbox"), dict) and "type" not in data["sandbox"]:
            data = {**data, "sandbox": {"type": "local", **data["sandbox"]}}
        return data


# --------------------------------------------------------------------------- the run


class ColocatedConfig(Section):
    """`mode: colocated`: generation and training alternate on the same ranks (agentrl/colocated)."""

    num_processes: int = Field(2, ge=1)
    """Ranks (torchrun processes on this machine): `t`-way tensor parallel times `num_processes/t`-way
    FSDP2 for training."""
    t: int = Field(1, ge=1)
    """Tensor-parallel degree of training (FSDP2 + TP on a (dp, tp) mesh when > 1); the ranks of one
    TP group train on the same micro-batches, the batch is split over the num_processes/t dp ranks."""
    tg: int = Field(1, ge=1)
    """Tensor-parallel degree of one generation engine replica; there are num_processes/tg replicas."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences one replica decodes together."""

    @model_validator(mode="after")
    def _layouts(self) -> ColocatedConfig:
        """The layouts the HybridEngine reshards between (agentrl/hybrid/reshard.py)."""
        n = self.num_processes
        if n % self.t:
            raise ValueError(f"colocated.t={self.t} must divide colocated.num_processes={n} (t-way TP × dp)")
        if n % self.tg:
            raise ValueError(
                f"colocated.tg={self.tg} must divide colocated.num_processes={n} (replicas of tg ranks)"
            )
        if self.t > 1 and self.tg > self.t:
            raise ValueError(
                f"colocated.tg={self.tg} above colocated.t={self.t}: the generation TP groups would stride across "
                "the (dp, tp) training mesh out of rank order (the lm_head's logits would gather permuted); use "
                "tg <= t, or t: 1"
            )
        if self.t > 1 and self.t % self.tg:
            raise ValueError(
                f"colocated.tg={self.tg} must divide colocated.t={self.t}: otherwise a generation TP group holds its "
                "shards out of rank order, as with tg > t"
            )
        return self


class AgentRLConfig(Section):
    """A whole run. Each component receives only its own section."""

    run_dir: str = "runs/default"
    """Directory of this run: resolved config, metrics, checkpoints, logs."""
    max_staleness: int = Field(1, ge=0)
    """Bound k on weight versions behind the learner: 0 is synchronous on-policy RL,
    1 is one-step-off-policy, k is bounded async. A group is trained on only if
    `v − min(versions) ≤ k`; rollers are admitted to start groups accordingly."""
    seed: int = 0
    """Global seed; components derive theirs from it unless set."""
    learner: LearnerConfig = LearnerConfig()
    roller: RollerConfig = RollerConfig()
    queue: QueueConfig = ZmqQueueConfig()
    inference: InferenceConfig = InferenceConfig()
    weight_sync: WeightSyncConfig = BroadcastSyncConfig()
    env: EnvConfig = EnvConfig()
    launcher: LauncherConfig = LauncherConfig()
    reward: RewardConfig = RewardConfig()
    mode: Literal["decoupled", "colocated"] = "decoupled"
    """decoupled: learner, servers and rollers are separate processes; colocated: `colocated.num_processes`
    ranks each generate, reshard and train in turn (on-policy: max_staleness is not used)."""
    colocated: ColocatedConfig = ColocatedConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_backend_types(cls, data: Any) -> Any:
        """A section that overrides backend fields without naming `type` keeps the default type."""
        if isinstance(data, dict):
            data = dict(data)
            for section, default in (("queue", "zmq"), ("weight_sync", "broadcast")):
                value = data.get(section)
                if isinstance(value, dict) and "type" not in value:
                    data[section] = {"type": default, **value}
        return data

    @model_validator(mode="after")
    def _cross_field_checks(self, info: ValidationInfo) -> AgentRLConfig:
        """Checks across sections. A command validates only the sections it uses (validation
        context `uses`, from `load_config(..., uses=...)`): `agentrl queue` is not refused over an
        incomplete `inference` section it never reads. No context: every check runs."""
        uses = (info.context or {}).get("uses") if info is not None else None

        def concerns(*sections: str) -> bool:
            return uses is None or set(sections) <= set(uses)

        # the clients of the servers need their URLs (`agentrl serve` is one; `agentrl run` starts them)
        clients = (concerns("inference", "weight_sync") or concerns("inference", "roller")) and not (
            uses is not None and "launcher" in uses
        )
        if clients and self.inference.type == "sglang" and not self.inference.servers:
            raise ValueError(
                "inference.servers: inference.type='sglang' needs the URLs of running SGLang servers "
                "(or let `agentrl run` start them: `agentrl serve --backend sglang`, from .venv-sglang)"
            )
        if concerns("learner", "roller") and self.learner.temperature != self.roller.temperature:
            raise ValueError(
                f"learner.temperature: must equal roller.temperature ({self.roller.temperature}); the learner "
                "recomputes log-probs of the distribution the rollers sampled from"
            )
        truncating = self.roller.top_p < 1 or self.roller.top_k > 0
        if concerns("inference", "roller") and self.inference.type == "vllm" and truncating:
            raise ValueError(
                f"roller.top_p={self.roller.top_p} / roller.top_k={self.roller.top_k} with inference.type: vllm: "
                "vLLM 0.32 reports log-probs after top-k/top-p (processed_logprobs) or before temperature "
                "(raw_logprobs), never the tempered full distribution the learner recomputes; set "
                "roller.top_p: 1 and roller.top_k: -1, or use inference.type: embedded or sglang"
            )
        if concerns("inference", "roller") and self.inference.logprobs == "truncated" and truncating:
            raise ValueError(
                f"inference.logprobs: 'truncated' with roller.top_p={self.roller.top_p} / roller.top_k="
                f"{self.roller.top_k}: the learner recomputes log_softmax(logits / temperature) over the full "
                "vocabulary and cannot reproduce truncated log-probs; set inference.logprobs: full, or "
                "roller.top_p: 1 and roller.top_k: -1"
            )
        if (
            concerns("inference")
            and self.inference.logprobs == "truncated"
            and self.inference.type == "sglang"
        ):
            raise ValueError(
                "inference.logprobs: SGLang 0.5.23 returns only full-distribution log-probs "
                "(srt/layers/sampler.py); use inference.logprobs: full with inference.type: sglang"
            )
        if self.mode == "colocated" and self.launcher.type == "ray":
            raise ValueError(
                "launcher.type: 'ray' does not start mode: colocated yet (its ranks run on one machine "
                "under torchrun); use launcher.type: local"
            )
        if (
            concerns("learner", "roller")
            and self.learner.loss.advantage == "remax"
            and not self.roller.greedy_baseline
        ):
            raise ValueError(
                "learner.loss.advantage: 'remax' needs roller.greedy_baseline: true (the rollers run the "
                "greedy episode whose reward is each group's baseline)"
            )
        if concerns("learner"):
            check_distill(self)  # learner.distill's refusals across sections (learner/distill.py)
        return self


SECTIONS = ("learner", "roller", "queue", "inference", "weight_sync", "env", "reward")
"""The component sections of `AgentRLConfig`, in the order `agentrl config show` prints them."""


# --------------------------------------------------------------------------- loading


def _read_preset(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(
                f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml, .toml or .json"
            )
    except (yaml.YAMLError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn `['--learner.optim.lr', '1e-6', '--roller.group_size=4']` into (dotted key, value) pairs.

    Values are read as YAML scalars/collections (`true`, `[a, b]`, `{k: v}`); pydantic then
    coerces and validates them against the field's type."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            i += 1
            value = args[i]
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        pairs.append((key.replace("-", "_"), parsed))
        i += 1
    return pairs


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `data[a][b][c] = value` for `a.b.c`, creating sections as needed."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _switch_backend(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`--queue.type redis` over a file whose queue section is zmq's: the file's keys that the new
    backend does not have (zmq's `address`) are dropped, with a log line, instead of failing
    validation; keys both have (and later overrides) stay."""
    *path, _ = dotted.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or node.get("type") in (None, value):
        return
    model: Any = AgentRLConfig
    for part in path:
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        members = _models_in(field.annotation) if field is not None else []
        if len(members) > 1:
            members = [m for m in members if m.model_fields["type"].default == value]
        if len(members) != 1:
            return  # not a tagged union here, or an unknown type: validation says so
        model = members[0]
    dropped = [k for k in node if k != "type" and k not in model.model_fields]
    for k in dropped:
        del node[k]
    if dropped:
        log.info("--%s %s: the preset's %s keys for type %s dropped: %s", dotted, value, ".".join(path),
                 node.get("type"), ", ".join(dropped))  # fmt: skip


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds: itself, or each member of a tagged union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _models_in(get_args(annotation)[0])
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model that an error location (minus its last part) points into.
    Locations inside a tagged union carry the tag, e.g. ('queue', 'zmq', 'capacity')."""
    candidates: list[type[BaseModel]] = [AgentRLConfig]
    for part in loc[:-1]:
        by_tag = {m.model_fields["type"].default: m for m in candidates if "type" in m.model_fields}
        if len(candidates) > 1 and part in by_tag:
            candidates = [by_tag[part]]
            continue
        field = candidates[0].model_fields.get(part) if len(candidates) == 1 else None
        if field is None:
            return None
        candidates = _models_in(field.annotation)
    return candidates[0] if len(candidates) == 1 else None


_UNION_TAGS = {"zmq", "redis", "broadcast", "disk", "local", "docker", "remote", "plugin"}


def format_validation_error(exc: ValidationError) -> str:
    """A readable, field-naming message for every problem in a config."""
    lines = []
    for err in exc.errors():
        raw_loc = tuple(err["loc"])
        loc = tuple(p for p in raw_loc if p not in _UNION_TAGS)
        where = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            model = _model_at(raw_loc)
            allowed = sorted(model.model_fields) if model else []
            close = difflib.get_close_matches(str(raw_loc[-1]), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"{where}: unknown key{hint}; allowed keys: {', '.join(allowed)}")
        elif err["type"] == "value_error" and not loc:
            # cross-field checks phrase their own message, starting with the field to change
            lines.append(str(err["ctx"]["error"]) if "ctx" in err else err["msg"])
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict) and "ctx" in err:
            lines.append(f"{where}: {err['ctx']['error']}")  # a section's own check (e.g. moved keys)
        else:
            given = err.get("input")
            shown = json.dumps(given, default=str) if not isinstance(given, dict) else "{...}"
            lines.append(f"{where}: {err['msg']} (got {shown})")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, uses: Collection[str] | None = None
) -> AgentRLConfig:
    """Load a preset (YAML/TOML), apply dotted overrides and validate. Every section's own fields
    are always checked; the checks across sections run only for the sections in `uses` (the
    ones the calling command reads; None: all of them)."""
    data = _read_preset(Path(path)) if path else {}
    for key, value in parse_overrides(overrides or []):
        if key.endswith(".type"):
            _switch_backend(data, key, value)
        apply_override(data, key, value)
    try:
        return AgentRLConfig.model_validate(data, context={"uses": set(uses)} if uses is not None else None)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def save_resolved(config: AgentRLConfig, run_dir: str | Path | None = None) -> Path:
    """Write the fully resolved config (every default filled in) into the run directory."""
    out = Path(run_dir or config.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.resolved.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if get_origin(annotation) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "")


def _describe_model(model: type[BaseModel], prefix: str, values: BaseModel | None) -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        nested = _models_in(field.annotation)
        current = getattr(values, name) if values is not None else None
        if nested and name != "type":
            variants = [m for m in nested if current is None or isinstance(current, m)]
            for sub in variants:
                tag = sub.model_fields.get("type")
                label = f"{prefix}{name}" + (f" (type: {tag.default})" if tag is not None else "")
                lines.append(f"{label}: {(sub.__doc__ or '').strip().splitlines()[0]}")
                lines += _describe_model(sub, f"{prefix}{name}.", current)
            continue
        default = field.get_default(call_default_factory=True)
        shown = f"{prefix}{name}: {_type_name(field.annotation)} = {json.dumps(default, default=str)}"
        if values is not None and current != default:
            shown += f"  (set: {json.dumps(getattr(values, name), default=str)})"
        lines.append("  " + shown)
        if field.description:
            lines += ["      " + line for line in field.description.splitlines()]
    return lines


def describe(config: AgentRLConfig | None = None, section: str | None = None) -> str:
    """Every field of the run config (or of one section) with its type, default and docstring,
    derived from the models themselves; with `config`, the values it sets beside the defaults."""
    if section is not None and section not in AgentRLConfig.model_fields:
        raise ConfigError(f"unknown section {section!r}; sections: {', '.join(AgentRLConfig.model_fields)}")
    lines: list[str] = []
    if section is None:
        lines.append("run-wide fields (--FIELD VALUE); then each section's (--section.field VALUE):")
        for name in AgentRLConfig.model_fields.keys() - set(SECTIONS):
            lines += _describe_model(_Only(AgentRLConfig, name), "", config)
    for name in SECTIONS if section is None else [section]:
        if name not in SECTIONS:  # a run-wide field asked for by name
            lines += _describe_model(_Only(AgentRLConfig, name), "", config)
            continue
        lines.append("")
        lines += _describe_model(_Only(AgentRLConfig, name), "", config)
    return "\n".join(lines).strip("\n") + "\n"


class _Only:
    """A view of one field of a model, so `_describe_model` can print a single section."""

    def __init__(self, model: type[BaseModel], name: str) -> None:
        self.model_fields = {name: model.model_fields[name]}
