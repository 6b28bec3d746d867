"""Typed configuration: the run's root model, assembled from one section per component.

A run is described by `AgentRLConfig`, whose sections (`learner`, `roller`, `queue`,
`inference`, `weight_sync`, `env`, `launcher`, `reward`, `colocated`) are each handed only to the
component that owns them. Each section's model lives beside its code (`agentrl/<package>/config.py`)
and imports nothing of that package's implementations; this module assembles them, re-exports
them, and holds what spans the run: the root model and its checks across sections, loading
presets (YAML or TOML, see `recipes/`) with dotted command-line overrides
(`--learner.optim.lr 1e-6`) on top, readable validation errors and `describe` (`agentrl config
show`). Every model forbids unknown keys and every field carries a docstring, which doubles as
CLI help and as the reference in `docs/config.md`. Validation happens before any process starts;
the error names the field to change and what it accepts.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

from agentrl.colocated.config import ColocatedConfig
from agentrl.envs.config import EnvConfig
from agentrl.envs.sandbox.config import (
    DockerSandboxConfig,
    IsolationLevel,
    LocalSandboxConfig,
    PluginSandboxConfig,
    RemoteSandboxConfig,
    SandboxConfig,
)
from agentrl.inference.config import InferenceConfig, VLLMLaunchConfig
from agentrl.launch.config import LauncherConfig
from agentrl.learner.config import (
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
from agentrl.learner.distill import check as check_distill
from agentrl.log import get_logger
from agentrl.observe.config import PrometheusConfig
from agentrl.queue.config import QueueConfig, RedisQueueConfig, ZmqQueueConfig
from agentrl.rewards.config import RewardConfig
from agentrl.rollers.config import RollerConfig
from agentrl.section import Section
from agentrl.weight_sync.config import BroadcastSyncConfig, DiskSyncConfig, WeightSyncConfig

log = get_logger("config")

__all__ = [
    "MOVED", "AgentRLConfig", "BroadcastSyncConfig", "CheckpointConfig", "ColocatedConfig", "ConfigError",
    "CriticConfig", "DiskSyncConfig", "DockerSandboxConfig", "EnvConfig", "InferenceConfig", "IsolationLevel",
    "LauncherConfig", "LearnerConfig", "LocalSandboxConfig", "LoggingConfig", "LossConfig", "OptimConfig",
    "PluginSandboxConfig", "QueueConfig", "RedisQueueConfig", "RemoteSandboxConfig", "RewardConfig",
    "RollerConfig", "SandboxConfig", "ScheduleConfig", "Section", "VLLMLaunchConfig", "WarmstartConfig",
    "WeightSyncConfig", "ZmqQueueConfig", "describe", "load_config", "save_resolved",
]  # fmt: skip


class ConfigError(ValueError):
    """A preset or override that does not describe a valid run."""


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
    prometheus: PrometheusConfig = PrometheusConfig()

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
        if concerns("inference", "roller"):
            self._check_sampled_logprobs()
        if (
            concerns("inference")
            and self.inference.logprobs == "truncated"
            and self.inference.type == "sglang"
        ):
            raise ValueError(
                "inference.logprobs: SGLang 0.5.23 returns only full-distribution log-probs "
                "(srt/layers/sampler.py); use inference.logprobs: full with inference.type: sglang"
            )
        self._check_deployment(concerns)
        if concerns("learner"):
            check_distill(self)  # learner.distill's refusals across sections (learner/distill.py)
        if (
            concerns("learner", "roller")
            and self.learner.loss.advantage == "remax"
            and not self.roller.greedy_baseline
        ):
            raise ValueError(
                "learner.loss.advantage: 'remax' needs roller.greedy_baseline: true (the rollers run the "
                "greedy episode whose reward is each group's baseline)"
            )
        return self

    def _check_router_replay(self) -> None:
        """Router replay needs the servers' routed experts in the episodes, and a learner that replays."""
        if not self.inference.routed_experts:
            raise ValueError(
                "learner.moe.router_replay: needs inference.routed_experts: true (the rollers then ask the "
                "servers for each token's routed experts and keep them in the episodes)"
            )
        if self.learner.backend not in ("fsdp2", "megatron"):
            raise ValueError(
                f"learner.moe.router_replay: the {self.learner.backend} backend does not replay routing; use "
                "learner.backend: fsdp2 or megatron"
            )
        if self.learner.backend == "megatron" and self.learner.megatron.pp > 1:
            raise ValueError(
                f"learner.moe.router_replay with learner.megatron.pp {self.learner.megatron.pp}: the log-probs "
                "without replay (the moe/mismatch_kl_k3_no_replay metric) take a second forward inside the "
                "last stage's loss, which needs one pipeline stage; set learner.megatron.pp: 1"
            )
        if self.mode == "colocated":
            raise ValueError(
                "learner.moe.router_replay: mode: colocated does not carry routed experts; use mode: decoupled"
            )

    def _check_deployment(self, concerns: Any) -> None:
        """What the chosen mode, adapters and MoE router replay can do together."""
        if concerns("learner", "inference") and self.learner.moe.router_replay:
            self._check_router_replay()
        lora = self.learner.lora
        if lora is not None and self.mode == "colocated" and concerns("learner", "colocated"):
            self._check_colocated_lora()
        if lora is None or not concerns("learner", "weight_sync"):
            return
        if lora.modules_to_save and self.weight_sync.lora_mode == "adapter":
            raise ValueError(
                f"weight_sync.lora_mode: 'adapter' pushes LoRA tensors only, and learner.lora.modules_to_save "
                f"{lora.modules_to_save} trains whole modules; set weight_sync.lora_mode: merged"
            )
        sync = self.weight_sync
        if (
            sync.lora_mode == "adapter"
            and sync.type == "disk"
            and sync.keep_last < 2
            and (self.inference.type in ("vllm", "sglang"))
        ):
            raise ValueError(
                f"weight_sync.keep_last: {sync.keep_last} deletes the adapter version {self.inference.type} still "
                "serves for requests in flight (and reloads from its directory when evicted); set it to 2 or more"
            )

    def _check_colocated_lora(self) -> None:
        """`learner.lora` with `mode: colocated`: the engines serve base + adapter through PEFT's
        layers on unsharded replicas (agentrl/colocated/loop.py): the base resharded once, or with
        `lora_mode: merged` base and adapter every step, merged in the generation buffers."""
        lora, cc = self.learner.lora, self.colocated
        if self.learner.backend != "fsdp2":
            raise ValueError(
                f"learner.lora with mode: colocated trains adapters on learner.backend fsdp2 only, not "
                f"{self.learner.backend}; use learner.backend: fsdp2, or mode: decoupled for Megatron + LoRA"
            )
        if cc.t > 1 or cc.tg > 1:
            raise ValueError(
                f"learner.lora with mode: colocated: colocated.t={cc.t}, colocated.tg={cc.tg}: adapters are "
                "trained and served without tensor parallel (the TP plan names the plain model's modules, "
                "and the engine applies adapters on whole replicas); set colocated.t: 1 and colocated.tg: 1"
            )
        if lora.modules_to_save:
            raise ValueError(
                f"learner.lora.modules_to_save {lora.modules_to_save} with mode: colocated: each step reshards "
                "the adapters' lora_A / lora_B only, onto a base resharded once; drop modules_to_save, or "
                "use mode: decoupled with weight_sync.lora_mode: merged"
            )
        if self.weight_sync.lora_mode == "merged" and cc.num_processes == 1:
            raise ValueError(
                "weight_sync.lora_mode: 'merged' with mode: colocated and colocated.num_processes: 1: the "
                "generation weights are then the training shards themselves (nothing is gathered), and "
                "merging the adapter into them would change the trained base; set weight_sync.lora_mode: "
                "adapter (the base resharded once, each step the adapter only)"
            )

    def _check_sampled_logprobs(self) -> None:
        """Top-k / top-p sampling only where the servers report the full tempered log-probs the
        learner recomputes."""
        if not (self.roller.top_p < 1 or self.roller.top_k > 0):
            return
        if self.inference.type == "vllm":
            raise ValueError(
                f"roller.top_p={self.roller.top_p} / roller.top_k={self.roller.top_k} with inference.type: vllm: "
                "vLLM 0.32 reports log-probs after top-k/top-p (processed_logprobs) or before temperature "
                "(raw_logprobs), never the tempered full distribution the learner recomputes; set "
                "roller.top_p: 1 and roller.top_k: -1, or use inference.type: embedded or sglang"
            )
        if self.inference.logprobs == "truncated":
            raise ValueError(
                f"inference.logprobs: 'truncated' with roller.top_p={self.roller.top_p} / roller.top_k="
                f"{self.roller.top_k}: the learner recomputes log_softmax(logits / temperature) over the full "
                "vocabulary and cannot reproduce truncated log-probs; set inference.logprobs: full, or "
                "roller.top_p: 1 and roller.top_k: -1"
            )


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
        for name in (n for n in AgentRLConfig.model_fields if n not in SECTIONS):
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
