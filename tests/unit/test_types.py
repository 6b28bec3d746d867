"""Episode / Group and the wire format: lossless round trips, hostile input refused."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.types import ARRAY_FIELDS, Episode, Group
from agentrl.wire import WireError, decode_group, decode_groups, encode_group


def make_episode(n: int = 10, prompt: int = 4, version: int = 3, reward: float = 1.0) -> Episode:
    mask = np.zeros(n, np.uint8)
    mask[prompt:] = 1
    versions = np.where(mask == 1, version, -1)
    logprobs = np.where(mask == 1, -0.5, 0.0)
    return Episode(np.arange(n), mask, logprobs, versions, reward=reward, num_turns=2, finish_reason="stop")


def test_episode_coerces_dtypes_and_checks_lengths() -> None:
    ep = make_episode()
    assert ep.tokens.dtype == np.int32 and ep.loss_mask.dtype == np.uint8
    assert ep.logprobs.dtype == np.float32 and ep.versions.dtype == np.int32
    with pytest.raises(ValueError, match="loss_mask has 3 entries, tokens has 4"):
        Episode([1, 2, 3, 4], [0, 1, 1], [0, 0, 0, 0], [-1, 0, 0, 0])
    with pytest.raises(ValueError, match="1-D"):
        Episode(np.zeros((2, 2)), np.zeros(4), np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="non-integral"):
        Episode([1.5], [1], [0.0], [0])


def test_staleness_is_judged_by_the_oldest_generated_token() -> None:
    ep = make_episode(version=5)
    ep.versions[6] = 2  # weights changed mid-episode: oldest generated token is version 2
    group = Group([ep, make_episode(version=7)])
    assert group.min_version == 2
    assert group.staleness(4) == 2
    assert group.is_admissible(4, max_staleness=2)
    assert not group.is_admissible(5, max_staleness=2)
    assert Group([make_episode(prompt=10)]).min_version == -1  # nothing generated


def test_round_trip_is_zero_copy_on_decode() -> None:
    group = Group([make_episode(), make_episode(n=3, prompt=1)], prompt_id="p1", metrics={"env": "toy"})
    frames = [bytes(f) for f in encode_group(group)]
    back = decode_group(frames)
    assert back.group_id == group.group_id and back.prompt_id == "p1" and back.metrics == {"env": "toy"}
    assert not back.episodes[0].tokens.flags.owndata  # a view over the received frame


def test_encode_does_not_copy_arrays() -> None:
    ep = make_episode(n=1000)
    frames = encode_group(Group([ep]))
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], np.int32), ep.tokens)


def test_array_frames_line_up_with_fields() -> None:
    frames = encode_group(Group([make_episode(n=5)]))
    assert len(frames) == 1 + len(ARRAY_FIELDS)
    for frame, (_, dtype) in zip(frames[1:], ARRAY_FIELDS, strict=True):
        assert len(frame) == 5 * dtype.itemsize


json_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=20)
metrics_st = st.dictionaries(
    st.text(max_size=10),
    st.recursive(
        json_leaf,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8,
    ),
    max_size=4,
)


@st.composite
def episodes(draw: st.DrawFn) -> Episode:
    n = draw(st.integers(0, 64))
    mask = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), np.uint8)
    versions = np.array(draw(st.lists(st.integers(-1, 2**31 - 1), min_size=n, max_size=n)), np.int32)
    logprobs = np.array(
        draw(st.lists(st.floats(width=32, allow_nan=True), min_size=n, max_size=n)), np.float32
    )
    tokens = np.array(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)), np.int32)
    return Episode(
        tokens,
        mask,
        logprobs,
        versions,
        reward=draw(st.floats(allow_nan=False)),
        num_turns=draw(st.integers(0, 1000)),
        finish_reason=draw(st.text(max_size=12)),
        metrics=draw(metrics_st),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(episodes(), max_size=6), st.text(max_size=16), metrics_st)
def test_round_trip_is_lossless(eps: list[Episode], prompt_id: str, metrics: dict) -> None:
    group = Group(eps, prompt_id=prompt_id, metrics=metrics)
    back = decode_group([bytes(f) for f in encode_group(group)])
    assert back.group_id == group.group_id and back.prompt_id == prompt_id
    assert _same(back.metrics, metrics)
    assert len(back.episodes) == len(eps)
    for a, b in zip(eps, back.episodes, strict=True):
        for name, _ in ARRAY_FIELDS:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))  # NaN-aware, bit-exact values
        assert (a.reward, a.num_turns, a.finish_reason) == (b.reward, b.num_turns, b.finish_reason)
        assert _same(a.metrics, b.metrics)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b and type(a) is type(b)


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames, header) -> list:
    return [msgpack.packb(header), *frames[1:]]


def _frames() -> list:
    return [bytes(f) for f in encode_group(Group([make_episode(), make_episode(n=6)]))]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: [], "no header"),
        (lambda f: [b"\xc1garbage", *f[1:]], "not valid msgpack"),
        (lambda f: [msgpack.packb([1, 2]), *f[1:]], "expected a map"),
        (lambda f: f[:-1], "expected 9 frames"),
        (lambda f: [*f, b"extra"], "expected 9 frames"),
        (lambda f: [f[0], f[1][:-4], *f[2:]], "tokens: 36 bytes, expected 10"),
        (lambda f: [f[0], f[1], f[2] + b"\x00", *f[3:]], "loss_mask"),
        (lambda f: [f[0], f[1], b"\x02" * 10, *f[3:]], "loss_mask: values must be 0 or 1"),
        (lambda f: [*f[:4], np.full(10, -7, np.int32).tobytes(), *f[5:]], "versions: values must be >= -1"),
        (lambda f: _with_header(f, {**_header(f), "evil": 1}), "unexpected fields ['evil']"),
        (
            lambda f: _with_header(f, {k: v for k, v in _header(f).items() if k != "group_id"}),
            "missing fields",
        ),
        (lambda f: _with_header(f, {**_header(f), "wire": 99}), "unsupported wire version 99"),
        (lambda f: _with_header(f, {**_header(f), "group_id": 5}), "group_id: expected str"),
        (lambda f: _with_header(f, {**_header(f), "episodes": "x"}), "episodes: expected list"),
        (lambda f: _with_header(f, {**_header(f), "episodes": [{"num_tokens": 1}] * 2}), "missing fields"),
        (lambda f: _with_header(f, {**_header(f), "metrics": {"k": b"\x00bytes"}}), "not a wire value"),
        (
            lambda f: _with_header(f, {**_header(f), "metrics": {"k": msgpack.ExtType(5, b"x")}}),
            "not a wire value",
        ),
        (lambda f: [msgpack.packb({1: 2}), *f[1:]], "not valid msgpack"),
    ],
)
def test_corrupt_messages_are_refused_with_a_clear_error(mutate, message: str) -> None:
    with pytest.raises(WireError) as info:
        decode_group(mutate(_frames()))
    assert message in str(info.value)


def test_episode_header_field_types_are_checked() -> None:
    frames = _frames()
    header = _header(frames)
    header["episodes"][0]["num_tokens"] = True
    with pytest.raises(WireError, match=r"episodes\[0\].num_tokens: expected int"):
        decode_group(_with_header(frames, header))
    header["episodes"][0]["num_tokens"] = -1
    with pytest.raises(WireError, match="negative"):
        decode_group(_with_header(frames, header))


def test_oversize_messages_are_refused() -> None:
    frames = [bytes(f) for f in encode_group(Group([make_episode(n=10_000)]))]
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_group(frames, max_bytes=1000)
    with pytest.raises(WireError, match="header of"):
        decode_group([b"\x00" * (5 << 20)])


def test_unencodable_metrics_are_refused_on_send() -> None:
    with pytest.raises(WireError, match="not a wire value"):
        encode_group(Group([make_episode()], metrics={"obj": object()}))
    with pytest.raises(WireError, match="keys must be strings"):
        encode_group(Group([make_episode()], metrics={1: 2}))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=12))
def test_random_bytes_never_crash_the_decoder(frames: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        decode_group(frames)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_bit_flips_in_a_valid_message_are_refused_or_decode_cleanly(data: st.DataObject) -> None:
    frames = _frames()
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    if frame:
        j = data.draw(st.integers(0, len(frame) - 1))
        frame[j] ^= data.draw(st.integers(1, 255))
    frames[i] = bytes(frame)
    try:
        group = decode_group(frames)
    except WireError:
        return
    for ep in group.episodes:  # whatever decodes is a well-formed group
        assert set(np.unique(ep.loss_mask)) <= {0, 1}
        assert len({len(getattr(ep, name)) for name, _ in ARRAY_FIELDS}) == 1


@contextlib.contextmanager
def _short_sizes(episode: int, batch: int = 1 << 16) -> Iterator[None]:
    """`decode_groups` with other SHORT_EPISODE / SHORT_BATCH limits: with episode 0 every
    episode takes the one-by-one path, with small limits short ones come in several batches."""
    import agentrl.wire as wire

    saved = wire.SHORT_EPISODE, wire.SHORT_BATCH
    wire.SHORT_EPISODE, wire.SHORT_BATCH = episode, batch
    try:
        yield
    finally:
        wire.SHORT_EPISODE, wire.SHORT_BATCH = saved


def _min_version(frames: list[bytes], short: int) -> int:
    with _short_sizes(short):
        ((_, min_version),) = decode_groups([frames])
    return min_version


@pytest.mark.parametrize("short", [1 << 12, 0])  # batched with other episodes, or one by one
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(eps=st.lists(episodes(), max_size=5))
def test_the_servers_min_version_agrees_with_the_group(short: int, eps: list[Episode]) -> None:
    assert _min_version([bytes(f) for f in encode_group(Group(eps))], short) == Group(eps).min_version


def _corrupt(frames: list[bytes], how: int) -> list[bytes]:
    """Frames of a group broken in one of three ways only a value or length check catches."""
    frames = list(frames)
    i = 1 + 4 * (len(frames) // 4 - 1)  # the last episode's tokens frame
    if how == 0:
        frames[i + 1] = bytes([2]) + frames[i + 1][1:]  # loss_mask 2
    elif how == 1:
        frames[i + 3] = np.full(len(frames[i + 3]) // 4, -2, np.int32).tobytes()  # version -2
    else:
        frames[i] = frames[i][:-4]  # tokens cut short
    return frames


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.lists(episodes(), max_size=4), max_size=8),
    st.sets(st.integers(0, 7)),
    st.integers(0, 2),
    st.sampled_from([(1 << 12, 1 << 16), (8, 20)]),
)
def test_decoding_many_groups_at_once_agrees_with_one_at_a_time(
    groups: list[list[Episode]], bad: set[int], how: int, sizes: tuple[int, int]
) -> None:
    """Every group decodes, or fails with the message `decode_group` gives, whatever its
    neighbours hold; with SHORT_EPISODE / SHORT_BATCH patched to 8 / 20 tokens, episodes take
    both paths and short ones are checked in several batches."""
    messages = []
    for g, eps in enumerate(groups):
        frames = [bytes(f) for f in encode_group(Group(eps))]
        broken = g in bad and eps and any(len(e.tokens) for e in eps[-1:])
        messages.append(_corrupt(frames, how) if broken else frames)
    with _short_sizes(*sizes):
        results = decode_groups(messages)
    assert len(results) == len(messages)
    for frames, result in zip(messages, results, strict=True):
        try:
            expected = decode_group(frames)
        except WireError as exc:
            assert isinstance(result, WireError) and str(result) == str(exc)
            continue
        group, min_version = result
        assert group.group_id == expected.group_id and min_version == _min_version(frames, 0)
        assert min_version == Group(expected.episodes).min_version
        for a, b in zip(group.episodes, expected.episodes, strict=True):
            for name, _ in ARRAY_FIELDS:
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_decoding_many_groups_keeps_each_groups_oldest_token_its_own() -> None:
    """The oldest generated token sits at a group's first or last position, or next to an
    older masked one: the batched reduction must not move it across a group boundary."""

    def group(*eps: tuple[list[int], list[int]]) -> list[bytes]:
        episodes = [Episode(np.zeros(len(v)), np.array(m), np.zeros(len(v)), np.array(v)) for v, m in eps]
        return [bytes(f) for f in encode_group(Group(episodes))]

    messages = [
        group(([5, 9, 9], [1, 1, 1])),
        group(([9, 9, 1], [1, 1, 1])),
        group(([0, 7], [0, 1])),
        group(([], []), ([3], [1])),
        group(([2, 8], [1, 1]), ([0, 4], [0, 0])),
    ]
    assert [r[1] for r in decode_groups(messages)] == [5, 1, 7, 3, 2]


@pytest.mark.parametrize("short", [1 << 12, 0])
def test_min_version_edge_values(short: int) -> None:
    def min_version(versions: list[int], mask: list[int]) -> int:
        n = len(versions)
        ep = Episode(np.zeros(n), np.array(mask), np.zeros(n), np.array(versions))
        return _min_version([bytes(f) for f in encode_group(Group([ep]))], short)

    assert min_version([2**31 - 1, 0], [1, 0]) == 2**31 - 1
    assert min_version([-1, 5], [1, 1]) == -1  # a generated token without a version
    assert min_version([7, 3], [0, 0]) == -1  # nothing generated
    assert min_version([], []) == -1


def test_header_fast_path_keeps_every_schema_check() -> None:
    frames = _frames()
    header = _header(frames)
    header["episodes"][0]["reward"] = 3  # an int reward is a valid float field
    assert decode_group(_with_header(frames, header)).episodes[0].reward == 3.0
    for field, value, message in [
        ("reward", True, "reward: expected float"),
        ("reward", "1", "reward: expected float"),
        ("num_turns", 1.0, "num_turns: expected int"),
        ("finish_reason", None, "finish_reason: expected str"),
        ("metrics", [], "metrics: expected dict"),
    ]:
        bad = _header(frames)
        bad["episodes"][1][field] = value
        with pytest.raises(WireError, match=re.escape(f"episodes[1].{message}")):
            decode_group(_with_header(frames, bad))
    bad = _header(frames)
    bad["episodes"][0]["extra"] = 1
    del bad["episodes"][0]["num_turns"]  # same number of keys, wrong names
    with pytest.raises(WireError, match="missing fields"):
        decode_group(_with_header(frames, bad))


def test_frames_of_any_buffer_kind_decode_and_strided_views_are_refused() -> None:
    frames = _frames()
    as_views = [memoryview(bytearray(f)) for f in frames]
    assert decode_group(as_views).group_id == decode_group(frames).group_id
    wide = [frames[0], *(memoryview(np.frombuffer(f, np.uint8)).cast("B") for f in frames[1:])]
    assert decode_group(wide).group_id == decode_group(frames).group_id
    strided = [frames[0], memoryview(frames[1] * 2)[::2], *frames[2:]]
    with pytest.raises(WireError, match="not a byte buffer"):
        decode_group(strided)


# --------------------------------------------------------------------------- per-turn rewards


def _turn_episode(n: int = 10) -> Episode:
    ep = make_episode(n=n)
    return Episode(ep.tokens, ep.loss_mask, ep.logprobs, ep.versions, reward=1.5, num_turns=2,
                   reward_pos=[5, n - 1], turn_rewards=[0.5, 1.0])  # fmt: skip


def test_per_turn_rewards_round_trip_and_add_frames_only_where_present() -> None:
    group = Group([make_episode(), _turn_episode(), make_episode(n=3, prompt=1)])
    frames = [bytes(f) for f in encode_group(group)]
    assert len(frames) == 1 + 4 * 3 + 2  # the two turn frames of episode 1 trail the per-token ones
    back = decode_group(frames)
    assert back.episodes[1].reward_pos.tolist() == [5, 9]
    assert back.episodes[1].turn_rewards.tolist() == [0.5, 1.0]
    assert back.episodes[0].reward_pos.size == back.episodes[2].turn_rewards.size == 0
    assert back.episodes[1].token_rewards().tolist() == [0, 0, 0, 0, 0, 0.5, 0, 0, 0, 1.0]
    # without per-turn rewards the episode's reward sits on its last generated token
    assert back.episodes[0].token_rewards().tolist() == [0] * 9 + [1.0]
    ((decoded, _),) = decode_groups([frames])
    assert decoded.episodes[1].reward_pos.tolist() == [5, 9]


def test_version_1_messages_still_decode_without_per_turn_rewards() -> None:
    frames = _frames()
    header = _header(frames)
    header["wire"] = 1
    del header["turns"]
    back = decode_group(_with_header(frames, header))
    assert [e.reward_pos.size for e in back.episodes] == [0, 0]
    assert back.episodes[0].tokens.tolist() == list(range(10))


def test_bad_per_turn_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0], reward_pos=[2, 2], turn_rewards=[1, 1])
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0], reward_pos=[3], turn_rewards=[1])
    with pytest.raises(ValueError, match="turn_rewards has 2 entries, reward_pos has 1"):
        Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0], reward_pos=[1], turn_rewards=[1, 1])
    frames = [bytes(f) for f in encode_group(Group([_turn_episode()]))]
    pos, rewards = 5, 6
    for mutate, message in [
        (
            lambda f: [*f[:pos], np.array([5, 10], np.int32).tobytes(), f[rewards]],
            "reward_pos: positions must",
        ),
        (lambda f: [*f[:pos], np.array([7, 3], np.int32).tobytes(), f[rewards]], "strictly increasing"),
        (lambda f: [*f[:pos], f[pos][:-4], f[rewards]], "reward_pos: 4 bytes, expected 2"),
        (lambda f: [*f[:rewards], f[rewards] + b"\x00"], "turn_rewards: 9 bytes"),
        (lambda f: f[:pos], "expected 7 frames"),
    ]:
        with pytest.raises(WireError, match=re.escape(message)):
            decode_group(mutate(frames))
    for turns in ([-1], [2, 0], [True], ["2"]):
        header = _header(frames)
        header["turns"] = turns
        with pytest.raises(WireError, match=r"header\.turns: expected 1 counts"):
            decode_group(_with_header(frames, header))
    header = _header(frames)
    header["turns"] = [3]
    with pytest.raises(WireError, match=re.escape("reward_pos: 8 bytes, expected 3")):
        decode_group(_with_header(frames, header))


def _moe_episode(n: int = 6, layers: int = 2, top_k: int = 2) -> Episode:
    experts = (np.arange(n * layers * top_k, dtype=np.int32).reshape(n, layers * top_k) % 4).copy()
    experts[-1] = -1  # the last token was sampled, never fed: no record
    return Episode(
        list(range(n)), [0, 0, 1, 1, 1, 1], [0.0] * n, [-1, -1, 0, 0, 0, 0], routed_experts=experts
    )


def test_routed_experts_travel_and_old_groups_still_decode() -> None:
    """A group with routed experts is a version 3 message whose episodes get their [T, layers·top_k]
    arrays back (an episode without routing stays None); a group without any is still the
    version 2 message, and both decode through `decode_group` and `decode_groups`."""
    plain = Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0])
    group = Group([_moe_episode(), plain, _turn_episode()])
    frames = encode_group(group)
    assert _header(frames)["wire"] == 3 and _header(frames)["experts"] == [4, 0, 0]
    for back in (decode_group(frames), decode_groups([frames])[0][0]):
        assert np.array_equal(back.episodes[0].routed_experts, group.episodes[0].routed_experts)
        assert back.episodes[1].routed_experts is None and back.episodes[2].routed_experts is None
        assert back.episodes[2].reward_pos.tolist() == [5, 9]
    old = encode_group(Group([plain]))
    assert _header(old)["wire"] == 2 and "experts" not in _header(old)
    assert decode_group(old).episodes[0].routed_experts is None


def test_bad_routed_experts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"must be \[3 tokens, layers·top_k\]"):
        Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0], routed_experts=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=">= -1"):
        Episode([1, 2, 3], [0, 1, 1], [0, 0, 0], [-1, 0, 0], routed_experts=np.full((3, 2), -2))
    frames = [bytes(f) for f in encode_group(Group([_moe_episode()]))]
    with pytest.raises(WireError, match=re.escape("routed_experts: 92 bytes, expected 6 × 4 × 4")):
        decode_group([*frames[:-1], frames[-1][:-4]])
    bad = np.frombuffer(frames[-1], np.int32).copy()
    bad[0] = -5
    with pytest.raises(WireError, match="routed_experts: values must be >= -1"):
        decode_group([*frames[:-1], bad.tobytes()])
    with pytest.raises(WireError, match="expected 6 frames"):
        decode_group(frames[:-1])
    for experts in ([-1], [4, 0], [True], ["4"]):
        header = _header(frames)
        header["experts"] = experts
        with pytest.raises(WireError, match=r"header\.experts: expected 1 widths"):
            decode_group(_with_header(frames, header))
