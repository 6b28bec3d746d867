"""The `reward` section: loaded with dotted overrides like every section, bad values refused naming
the field."""

from __future__ import annotations

import pytest

from agentrl.config import ConfigError, load_config


def test_reward_overrides_load_and_default_to_no_reward_model() -> None:
    assert load_config(None, []).reward.url is None
    cfg = load_config(
        None,
        ["--reward.url=http://127.0.0.1:30100", "--reward.weight", "0.5", "--roller.greedy_baseline=true"],
    )
    assert (cfg.reward.url, cfg.reward.weight, cfg.reward.kind) == (
        "http://127.0.0.1:30100",
        0.5,
        "classifier",
    )
    assert cfg.roller.greedy_baseline is True


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--reward.kind=oracle", "reward.kind"),
        ("--reward.timeout_s=0", "reward.timeout_s"),
        ("--reward.scorer=x", "reward.scorer"),
    ],
)
def test_bad_reward_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_judge_prompt_without_the_transcript_slot_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"reward.judge_prompt: must contain \{transcript\}"):
        load_config(None, ["--reward.kind=judge", "--reward.judge_prompt=Is it good?"])
