"""Config loading: presets, dotted overrides, and refusals that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentrl.config import (
    SECTIONS,
    AgentRLConfig,
    ConfigError,
    DiskSyncConfig,
    RedisQueueConfig,
    describe,
    load_config,
    parse_overrides,
    save_resolved,
)

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid() -> None:
    cfg = AgentRLConfig()
    assert cfg.queue.type == "zmq"
    assert cfg.weight_sync.type == "broadcast"
    assert cfg.max_staleness == 1


@pytest.mark.parametrize("preset", sorted((REPO / "recipes").glob("*.y*ml")), ids=lambda p: p.name)
def test_every_recipe_validates(preset: Path) -> None:
    load_config(preset)


def test_yaml_and_toml_presets_agree(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "max_staleness: 2\nlearner:\n  optim:\n    lr: 3.0e-4\nqueue:\n  type: redis\n"
    )
    (tmp_path / "a.toml").write_text(
        'max_staleness = 2\n[learner.optim]\nlr = 3e-4\n[queue]\ntype = "redis"\n'
    )
    a = load_config(tmp_path / "a.yaml")
    b = load_config(tmp_path / "a.toml")
    assert a == b
    assert isinstance(a.queue, RedisQueueConfig)
    assert a.learner.optim.lr == pytest.approx(3e-4)


def test_dotted_overrides_apply_on_top_of_preset(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("learner:\n  optim:\n    lr: 1.0e-3\n  max_steps: 5\n")
    cfg = load_config(
        tmp_path / "p.yaml",
        [
            "--learner.optim.lr",
            "1e-6",
            "--roller.group_size=4",
            "--env.kwargs",
            "{digits: 2}",
            "--weight_sync.type",
            "disk",
        ],
    )
    assert cfg.learner.optim.lr == pytest.approx(1e-6)
    assert cfg.learner.max_steps == 5  # untouched preset value survives
    assert cfg.roller.group_size == 4
    assert cfg.env.kwargs == {"digits": 2}
    assert isinstance(cfg.weight_sync, DiskSyncConfig)


@pytest.mark.parametrize(
    ("flat", "new"),
    [("lr", "optim.lr"), ("warmup_steps", "schedule.warmup_steps"), ("kl_coef", "loss.kl_coef"),
     ("checkpoint_every", "checkpoint.every"), ("tensorboard", "logging.tensorboard"),
     ("warmstart_steps", "warmstart.steps")],
)  # fmt: skip
def test_old_flat_learner_keys_are_refused_naming_the_new_key(tmp_path: Path, flat: str, new: str) -> None:
    with pytest.raises(ConfigError, match=rf"learner\.{flat} is now learner\.{new}"):
        load_config(None, [f"--learner.{flat}", "1"])
    (tmp_path / "old.yaml").write_text(f"learner:\n  {flat}: 1\n")
    with pytest.raises(ConfigError, match=rf"learner\.{flat} is now learner\.{new}"):
        load_config(tmp_path / "old.yaml")


def test_the_resolved_config_is_one_file_with_the_learner_sub_sections(tmp_path: Path) -> None:
    cfg = load_config(None, ["--learner.optim.lr", "3e-4", "--learner.checkpoint.every", "5"])
    path = save_resolved(cfg, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.resolved.yaml"]
    data = yaml.safe_load(path.read_text())
    assert (
        data["learner"]["optim"]["lr"] == pytest.approx(3e-4) and data["learner"]["checkpoint"]["every"] == 5
    )
    assert load_config(path) == cfg  # the resolved file loads back as the same config


def test_backend_fields_without_type_keep_default_backend() -> None:
    cfg = load_config(None, ["--queue.capacity_groups", "7"])
    assert cfg.queue.type == "zmq" and cfg.queue.capacity_groups == 7


def test_switching_a_backend_on_the_command_line_drops_the_presets_keys_it_does_not_have(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """quickstart.yaml's queue is zmq with an `address`: `--queue.type redis` drops that key (a
    log line says so) instead of refusing the run; keys the new type has, and overrides, stay."""
    recipes = Path(__file__).parents[2] / "recipes"
    with caplog.at_level("INFO", logger="agentrl.config"):
        cfg = load_config(
            recipes / "quickstart.yaml", ["--queue.type", "redis", "--queue.capacity_groups", "9"]
        )
    assert cfg.queue.type == "redis" and cfg.queue.capacity_groups == 9
    assert "queue keys for type zmq dropped: address" in caplog.text
    cfg = load_config(recipes / "swe.yaml", ["--env.sandbox.type", "docker"])  # a nested union
    assert cfg.env.sandbox.type == "docker" and cfg.env.sandbox.memory_mb == 1024
    with pytest.raises(ConfigError, match="does not match any of the expected tags"):
        load_config(recipes / "quickstart.yaml", ["--queue.type", "rabbitmq"])
    with pytest.raises(ConfigError, match="address"):  # a key given for the new type is still checked
        load_config(recipes / "quickstart.yaml", ["--queue.type", "redis", "--queue.address", "tcp://x:1"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["--learner.optim.lrr", "1"],
            ["learner.optim.lrr", "unknown key", "did you mean 'lr'", "allowed keys"],
        ),
        (["--learner.lrr", "1"], ["learner.lrr", "unknown key", "allowed keys", "optim"]),
        (["--nonsense", "1"], ["nonsense: unknown key", "learner", "roller"]),
        (["--queue.capcity_groups", "3"], ["queue.capcity_groups", "capacity_groups"]),
        (["--queue.type", "redis", "--queue.durable", "true"], ["queue.durable", "unknown key", "stream"]),
        (["--learner.optim.lr", "-1"], ["learner.optim.lr", "greater than 0"]),
        (["--max_staleness", "-1"], ["max_staleness", "greater than or equal to 0"]),
        (["--roller.group_size", "many"], ["roller.group_size", "valid integer", "many"]),
        (["--learner.loss.advantage", "ppo"], ["learner.loss.advantage", "'grpo'", "'rloo'", "'gae'"]),
        (["--queue.type", "kafka"], ["queue", "'zmq'", "'redis'"]),
        (["--learner.loss.clip_high", "0.1"], ["learner.loss: clip_high", "clip_low"]),
        (["--learner.loss.clip_low", "null"], ["learner.loss: clip_low", "cispo"]),
        (["--inference.type", "sglang"], ["inference.servers"]),
        (["--learner.optim.lr"], ["--learner.optim.lr has no value"]),
        (["learner.lr", "3"], ["unexpected argument"]),
        (["--colocated.partial_rollout", "1.5"], ["colocated.partial_rollout", "1"]),
        (["--learner.loss.advantage", "remax"], ["learner.loss.advantage", "roller.greedy_baseline"]),
    ],
)
def test_bad_configs_are_refused_naming_the_field(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_bad_preset_files(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("learner: [unclosed\n")
    (tmp_path / "x.ini").write_text("[learner]\n")
    for name, fragment in [
        ("list.yaml", "mapping"),
        ("broken.yaml", "cannot parse"),
        ("x.ini", "unknown config"),
        ("missing.yaml", "not found"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(tmp_path / name)


def test_every_field_is_documented() -> None:
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = field.annotation
            members = [
                a for a in getattr(sub, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                walk(sub, f"{prefix}{name}.")
            elif members:
                for m in members:
                    walk(m, f"{prefix}{name}.")
            elif name != "type":
                assert field.description, f"{prefix}{name} has no docstring"

    walk(AgentRLConfig, "")


def test_resolved_config_is_written_and_reloads(tmp_path: Path) -> None:
    cfg = load_config(REPO / "recipes" / "quickstart.yaml", [f"--run_dir={tmp_path / 'run'}", "--seed", "3"])
    path = save_resolved(cfg)
    assert path == tmp_path / "run" / "config.resolved.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["seed"] == 3 and data["learner"]["loss"]["advantage"] == "grpo"  # defaults are filled in
    assert load_config(path) == cfg


def test_parse_overrides_reads_yaml_values() -> None:
    assert parse_overrides(["--a.b", "true", "--c=[1, 2]", "--d", "text", "--e-f", "1"]) == [
        ("a.b", True),
        ("c", [1, 2]),
        ("d", "text"),
        ("e_f", 1),
    ]


def test_each_command_validates_only_the_sections_it_uses() -> None:
    overrides = ["--inference.type", "sglang"]  # no servers: only commands that use inference care
    config = load_config(None, overrides, uses=("queue", "learner"))
    assert config.inference.type == "sglang"
    with pytest.raises(ConfigError, match=r"inference\.servers"):
        load_config(None, overrides, uses=("roller", "env", "inference", "queue"))
    with pytest.raises(ConfigError, match=r"inference\.servers"):
        load_config(None, overrides)  # no command named: every check
    from agentrl.cli_common import USES

    for command in (
        "run",
        "serve",
    ):  # `agentrl run` starts the SGLang servers; `serve --backend sglang` is one
        assert load_config(None, overrides, uses=USES[command]).inference.type == "sglang"
    with pytest.raises(ConfigError, match=r"inference\.servers"):
        load_config(None, overrides, uses=USES["learner"])
    with pytest.raises(ConfigError, match=r"learner\.lrr"):  # a section's own fields always count
        load_config(None, ["--learner.lrr", "1"], uses=("queue",))


def test_describe_prints_every_field_with_its_doc_and_default() -> None:
    text = describe()
    for section in SECTIONS:
        assert f"\n{section}" in text
    assert "  learner.optim.lr: float = 1e-05\n      Peak learning rate of AdamW." in text
    assert "queue (type: redis)" in text and "env.sandbox (type: docker)" in text
    assert "  env.sandbox.memory_mb: int = 1024" in text
    shown = describe(load_config(None, ["--roller.group_size", "4"]), "roller")
    assert shown.startswith("roller:") and "roller.group_size: int = 8  (set: 4)" in shown
    assert "learner." not in shown
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        describe(None, "nope")


def test_megatron_lora_refuses_modules_to_save() -> None:
    AgentRLConfig(learner={"backend": "megatron", "lora": {"rank": 4}})  # adapters alone: accepted
    with pytest.raises(ValueError, match=r"lora.modules_to_save \['lm_head'\]: backend megatron"):
        AgentRLConfig(learner={"backend": "megatron", "lora": {"modules_to_save": ["lm_head"]}})
