"""The wire format of a `Group` (`agentrl.types`): `encode_group`, and `decode_group` /
`decode_groups`, which treat their input as hostile.

A group is a list of frames: one msgpack header, then the four arrays of each episode as raw
frames (`tokens`, `loss_mask`, `logprobs`, `versions`), then, for each episode that has
per-turn rewards, its two turn arrays (`reward_pos`, `turn_rewards`), then, for each episode
that carries routed experts (mixture-of-experts models), its `routed_experts` frame, so a sender can hand
numpy buffers to ZeroMQ with `copy=False` and a receiver can view them with `np.frombuffer`
without a copy. An episode without per-turn rewards adds no frame. There is no pickle
anywhere. The decoder checks the header schema, frame count, dtypes, lengths and value
ranges, and raises `WireError` naming what is wrong. Wire version 2 added the per-turn
rewards; version 1 messages (no `turns` in the header, no turn frames) still decode, with
none. Version 3 adds the routed experts (`experts` in the header: each episode's layers × top_k
width, 0 for none); a group without any is still written as version 2, and versions 1 and 2
decode with none. `_parse`'s fast path is tied to `types.ARRAY_FIELDS` by an assertion: a new field in
`Episode` is a new check here.

This module imports nothing from agentrl but `agentrl.types`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from agentrl.types import ARRAY_FIELDS, TURN_FIELDS, Episode, Group, turn_problem

WIRE_VERSION = 3
WIRE_VERSIONS = (1, 2, 3)  # decoded; 1 is 2 without per-turn rewards, 2 is 3 without routed experts

DEFAULT_MAX_BYTES = 256 << 20
MAX_HEADER_BYTES = 4 << 20
MAX_EPISODES_PER_GROUP = 4096
MAX_METRICS_DEPTH = 16


class WireError(ValueError):
    """A wire message that is not a well-formed group."""


def _check_metrics(value: Any, where: str, depth: int = 0) -> None:
    """Metrics travel in the msgpack header: plain JSON-like values only."""
    if depth > MAX_METRICS_DEPTH:
        raise WireError(f"{where}: nested deeper than {MAX_METRICS_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_metrics(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{where}: keys must be strings, got {type(key).__name__}")
            _check_metrics(item, f"{where}.{key}", depth + 1)
        return
    raise WireError(
        f"{where}: {type(value).__name__} is not a wire value (use str, int, float, bool, list, dict)"
    )


def encode_group(group: Group) -> list[bytes | memoryview]:
    """Frames for one group: a msgpack header, 4 raw array frames per episode, then 2 per
    episode that has per-turn rewards, then 1 per episode that has routed experts.

    The array frames are memoryviews of the episodes' own buffers (no copy)."""
    _check_metrics(group.metrics, "group.metrics")
    episodes = []
    frames: list[bytes | memoryview] = []
    turn_frames: list[bytes | memoryview] = []
    expert_frames: list[bytes | memoryview] = []
    for i, ep in enumerate(group.episodes):
        _check_metrics(ep.metrics, f"episodes[{i}].metrics")
        episodes.append(
            {
                "num_tokens": ep.num_tokens,
                "reward": ep.reward,
                "num_turns": ep.num_turns,
                "finish_reason": ep.finish_reason,
                "metrics": ep.metrics,
            }
        )
        for name, _ in ARRAY_FIELDS:
            frames.append(memoryview(getattr(ep, name)).cast("B"))
        if len(ep.reward_pos):
            turn_frames += [memoryview(ep.reward_pos).cast("B"), memoryview(ep.turn_rewards).cast("B")]
        if ep.routed_experts is not None:
            expert_frames.append(memoryview(ep.routed_experts.reshape(-1)).cast("B"))
    frames += turn_frames + expert_frames
    # rewarded turns per episode, or [] when no episode has any (the common case costs nothing more)
    turns = [len(ep.reward_pos) for ep in group.episodes] if turn_frames else []
    header = {
        "wire": WIRE_VERSION if expert_frames else 2,  # no routed experts: the version 2 message
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "metrics": group.metrics,
        "episodes": episodes,
        "turns": turns,
    }
    if expert_frames:
        header["experts"] = [
            ep.routed_experts.shape[1] if ep.routed_experts is not None else 0 for ep in group.episodes
        ]
    return [msgpack.packb(header, use_bin_type=True), *frames]


_HEADER_KEYS_V1 = {"wire": int, "group_id": str, "prompt_id": str, "metrics": dict, "episodes": list}
_HEADER_KEYS_V2 = {**_HEADER_KEYS_V1, "turns": list}
_HEADER_KEYS = {**_HEADER_KEYS_V2, "experts": list}
_EPISODE_KEYS = {"num_tokens": int, "reward": float, "num_turns": int, "finish_reason": str, "metrics": dict}


def _check_keys(obj: Any, schema: dict[str, type], where: str) -> None:
    if not isinstance(obj, dict):
        raise WireError(f"{where}: expected a map, got {type(obj).__name__}")
    missing = schema.keys() - obj.keys()
    extra = obj.keys() - schema.keys()
    if missing:
        raise WireError(f"{where}: missing fields {sorted(missing)}")
    if extra:
        raise WireError(f"{where}: unexpected fields {sorted(map(str, extra))}")
    for key, typ in schema.items():
        value = obj[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float else None
        if ok is None:
            ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            raise WireError(f"{where}.{key}: expected {typ.__name__}, got {type(value).__name__}")


def byte_view(frame: Any) -> memoryview:
    """A flat byte view of bytes, a memoryview, a numpy array or a zmq.Frame (anything exposing
    the buffer protocol); `WireError` for anything else or a strided view."""
    if type(frame) is not memoryview:
        try:
            frame = memoryview(frame)
        except TypeError as exc:
            raise WireError(f"frame of type {type(frame).__name__} is not a byte buffer") from exc
    if frame.format == "B" and frame.ndim == 1 and frame.contiguous:
        return frame  # the common case: nothing to re-cast
    try:
        return frame.cast("B")
    except TypeError as exc:
        raise WireError(f"frame of type {type(frame).__name__} is not a byte buffer") from exc


def _exact_types(schema: dict[str, type]) -> tuple[tuple[str, tuple[type, ...]], ...]:
    """Each key with the exact types msgpack produces for it (an int where a float is asked)."""
    return tuple((key, (float, int) if typ is float else (typ,)) for key, typ in schema.items())


_HEADER_EXACT = _exact_types(_HEADER_KEYS)
_HEADER_SCHEMA = {
    1: (_HEADER_KEYS_V1, _exact_types(_HEADER_KEYS_V1)),
    2: (_HEADER_KEYS_V2, _exact_types(_HEADER_KEYS_V2)),
    3: (_HEADER_KEYS, _HEADER_EXACT),
}
_EPISODE_EXACT = _exact_types(_EPISODE_KEYS)
_NO_POS = np.zeros(0, dict(TURN_FIELDS)["reward_pos"])
_NO_REWARDS = np.zeros(0, dict(TURN_FIELDS)["turn_rewards"])
_NO_POS.flags.writeable = _NO_REWARDS.flags.writeable = False


def _schema_ok(obj: Any, exact: tuple[tuple[str, tuple[type, ...]], ...]) -> bool:
    """Fast path of `_check_keys`: a dict of exactly the schema's keys, each value of an exact
    type. False sends the map through `_check_keys`, which accepts it or names what is wrong."""
    if type(obj) is not dict or len(obj) != len(exact):
        return False
    for key, types in exact:  # noqa: SIM110 - all() over a generator takes ~1.8x as long here
        if type(obj.get(key)) not in types:
            return False
    return True


def _check_plain_metrics(value: Any, where: str) -> None:
    if value:  # the common empty map needs no walk
        _check_metrics(value, where)


def _episode(arrays: list[np.ndarray], em: dict, routed: np.ndarray | None = None) -> Episode:
    """An `Episode` of already validated arrays and header fields (skips the coercions of
    `Episode.__post_init__`, which would find nothing to do: `decode_group` checked it all)."""
    ep = Episode.__new__(Episode)
    ep.__dict__.update(
        tokens=arrays[0],
        loss_mask=arrays[1],
        logprobs=arrays[2],
        versions=arrays[3],
        reward=float(em["reward"]),  # NaN/inf pass: the learner skips and counts them with a reason
        num_turns=em["num_turns"],
        finish_reason=em["finish_reason"],
        metrics=em["metrics"],
        reward_pos=arrays[4] if len(arrays) > _N_FIELDS else _NO_POS,
        turn_rewards=arrays[5] if len(arrays) > _N_FIELDS else _NO_REWARDS,
        routed_experts=routed,
    )
    return ep


_MAX_MASK = np.maximum.reduce
_MIN_VERSION = np.minimum.reduce
_N_FIELDS = len(ARRAY_FIELDS)
_DTYPES = tuple(dtype for _, dtype in ARRAY_FIELDS)
_I4, _U1, _F4 = (np.dtype(t) for t in ("<i4", "u1", "<f4"))
assert _DTYPES == (_I4, _U1, _F4, _I4), "ARRAY_FIELDS changed: update _parse and _length_error"
_frombuffer = np.frombuffer


def _parse(
    frames: Sequence[Any], max_bytes: int
) -> tuple[dict, list[list[np.ndarray]], list[np.ndarray | None]]:
    """The header, each episode's arrays (zero-copy views) and routed experts (None: none), with
    every check except the arrays' values (`_check_values`)."""
    if not frames:
        raise WireError("empty message: no header frame")
    header = _parse_header(frames[0])
    meta = header["episodes"]
    turns = header.get("turns") or ()
    experts = header.get("experts") or ()
    expected_frames = (
        1
        + _N_FIELDS * len(meta)
        + (2 * (len(turns) - turns.count(0)) if turns else 0)
        + (len(experts) - experts.count(0) if experts else 0)
    )
    if len(frames) != expected_frames:
        raise WireError(f"expected {expected_frames} frames for {len(meta)} episodes, got {len(frames)}")
    bufs = [byte_view(f) for f in frames[1:]]
    total = sum(map(len, bufs))
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes}")

    episodes = []
    turn_frame = _N_FIELDS * len(meta)  # the first turn frame
    for i, em in enumerate(meta):
        if not _schema_ok(em, _EPISODE_EXACT):
            _check_keys(em, _EPISODE_KEYS, f"episodes[{i}]")
        _check_plain_metrics(em["metrics"], f"episodes[{i}].metrics")
        n = em["num_tokens"]
        if n < 0:
            raise WireError(f"episodes[{i}].num_tokens: negative ({n})")
        tokens, mask, logprobs, versions = bufs[i * _N_FIELDS : (i + 1) * _N_FIELDS]
        if len(mask) != n or len(tokens) != 4 * n or len(logprobs) != 4 * n or len(versions) != 4 * n:
            raise _length_error(i, n, (tokens, mask, logprobs, versions))
        arrays = [
            _frombuffer(tokens, _I4),
            _frombuffer(mask, _U1),
            _frombuffer(logprobs, _F4),
            _frombuffer(versions, _I4),
        ]
        if turns and turns[i]:
            arrays += _turn_arrays(i, n, turns[i], bufs[turn_frame], bufs[turn_frame + 1])
            turn_frame += 2
        episodes.append(arrays)
    routed: list[np.ndarray | None] = [None] * len(meta)
    expert_frame = turn_frame
    for i, width in enumerate(experts):
        if width:
            routed[i] = _expert_array(i, meta[i]["num_tokens"], width, bufs[expert_frame])
            expert_frame += 1
    return header, episodes, routed


def _expert_array(i: int, n: int, width: int, buf: memoryview) -> np.ndarray:
    """Episode i's routed experts ([n, width] int32), its length and values checked."""
    if len(buf) != 4 * n * width:
        raise WireError(
            f"episodes[{i}].routed_experts: {len(buf)} bytes, expected {n} × {width} × 4 "
            f"for {n} tokens of {width} int32 experts"
        )
    experts = _frombuffer(buf, _I4).reshape(n, width)
    if experts.size and int(experts.min()) < -1:
        raise WireError(f"episodes[{i}].routed_experts: values must be >= -1")
    return experts


def _parse_header(frame: Any) -> dict:
    """The msgpack header of a message, checked: its schema for its wire version, its metrics,
    the episode count and the per-episode counts of rewarded turns."""
    header_buf = byte_view(frame)
    if len(header_buf) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(header_buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(header_buf, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise WireError(f"header is not valid msgpack: {exc}") from None
    wire = header.get("wire") if type(header) is dict else None
    newest = WIRE_VERSION if type(header) is dict and "experts" in header else 2  # for an unknown version
    keys, exact = _HEADER_SCHEMA.get(wire, _HEADER_SCHEMA[newest])  # type: ignore[arg-type]
    if not _schema_ok(header, exact):
        _check_keys(header, keys, "header")
    wire = header["wire"]
    if wire not in WIRE_VERSIONS:
        raise WireError(f"header.wire: unsupported wire version {wire} (this build speaks {WIRE_VERSIONS})")
    _check_plain_metrics(header["metrics"], "header.metrics")
    meta = header["episodes"]
    if len(meta) > MAX_EPISODES_PER_GROUP:
        raise WireError(f"header.episodes: {len(meta)} episodes exceed {MAX_EPISODES_PER_GROUP}")
    _check_counts(header, "turns", len(meta), "counts of rewarded turns")
    _check_counts(header, "experts", len(meta), "widths of routed experts")
    return header


def _check_counts(header: dict, key: str, episodes: int, what: str) -> None:
    """`header[key]`, when present, holds one int >= 0 per episode."""
    counts = header.get(key) or ()
    if counts and (len(counts) != episodes or any(type(k) is not int or k < 0 for k in counts)):
        raise WireError(f"header.{key}: expected {episodes} {what} (ints >= 0), got {counts!r:.80}")


def _turn_arrays(i: int, n: int, k: int, pos_buf: memoryview, reward_buf: memoryview) -> tuple:
    """The per-turn arrays of episode i (n tokens, k rewarded turns), with their checks: a turn
    array is short, so its values are checked here rather than in the batched value pass."""
    for (name, dtype), buf in zip(TURN_FIELDS, (pos_buf, reward_buf), strict=True):
        if len(buf) != k * dtype.itemsize:
            raise WireError(
                f"episodes[{i}].{name}: {len(buf)} bytes, expected {k} × {dtype.itemsize} for {k} turns of {dtype}"
            )
    pos = _frombuffer(pos_buf, _I4)
    problem = turn_problem(pos, n)
    if problem:
        raise WireError(f"episodes[{i}].reward_pos: {problem}")
    return pos, _frombuffer(reward_buf, _F4)


def _length_error(i: int, n: int, bufs: Sequence[memoryview]) -> WireError:
    for (name, dtype), buf in zip(ARRAY_FIELDS, bufs, strict=True):
        if len(buf) != n * dtype.itemsize:
            return WireError(
                f"episodes[{i}].{name}: {len(buf)} bytes, expected {n} × {dtype.itemsize} "
                f"for {n} tokens of {dtype}"
            )
    raise AssertionError("no array has a wrong length")


def _check_values(i: int, arrays: list[np.ndarray]) -> None:
    if len(arrays[1]) and _MAX_MASK(arrays[1]) > 1:
        raise WireError(f"episodes[{i}].loss_mask: values must be 0 or 1")
    if len(arrays[3]) and _MIN_VERSION(arrays[3]) < -1:
        raise WireError(f"episodes[{i}].versions: values must be >= -1")


def _build(header: dict, episodes: list[list[np.ndarray]], routed: list[np.ndarray | None]) -> Group:
    return Group(
        [
            _episode(arrays, em, experts)
            for arrays, em, experts in zip(episodes, header["episodes"], routed, strict=True)
        ],
        group_id=header["group_id"],
        prompt_id=header["prompt_id"],
        metrics=header["metrics"],
    )


def decode_group(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> Group:
    """Rebuild a group from its frames, validating everything. Arrays are zero-copy
    views of the frames. Raises `WireError` for anything that is not a valid group.

    This runs once per group on the queue server, so the common case is kept cheap (exact-type
    schema checks, no re-coercion of arrays); every check of the slow path still applies."""
    header, episodes, routed = _parse(frames, max_bytes)
    for i, arrays in enumerate(episodes):
        _check_values(i, arrays)
    return _build(header, episodes, routed)


_U32_MAX = np.uint32(0xFFFFFFFF)
_U32_MAX_MINUS_1 = np.uint32(0xFFFFFFFE)


def _token_keys(versions: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """mask * ~u per token, with u = versions + 1 as uint32; the max is the key of the oldest
    generated token.

    Relies on what the value checks established (loss_mask in {0, 1}, versions >= -1): u is in
    [0, 2^31], ~u = 2^32-2 - versions (mod 2^32), so the masked min of u is `2^32-1 - key` and a
    key of 0 means no generated token. Two vector passes, several times cheaper than a masked
    reduction or boolean indexing on long episodes."""
    keys = np.subtract(_U32_MAX_MINUS_1, versions.view(np.uint32))
    keys *= loss_mask
    return keys


def _generated_key(versions: np.ndarray, loss_mask: np.ndarray) -> int:
    return int(np.maximum.reduce(_token_keys(versions, loss_mask))) if len(versions) else 0


def _min_version(key: int) -> int:
    """`Group.min_version` from the largest `_token_keys` of the group (0: nothing generated)."""
    return -1 if key == 0 else int(_U32_MAX) - key - 1


SHORT_EPISODE = 1 << 12  # tokens; `decode_groups` checks shorter episodes of all its groups together
SHORT_BATCH = 1 << 16  # tokens per concatenation: it stays in cache and off fresh pages


def decode_groups(
    messages: Sequence[Sequence[Any]], max_bytes: int = DEFAULT_MAX_BYTES
) -> list[tuple[Group, int] | WireError]:
    """`decode_group` for the groups of one message, each with its min version (`Group.min_version`,
    computed in a few vector passes).

    A group that fails gets its `WireError` in its place; the others are unaffected. The value
    checks and min versions of short episodes are done a few vector passes per batch of them
    (concatenated) instead of several per episode: for thousands of small groups per second
    those per-call costs are what the queue server would otherwise spend its time on."""
    results: list[Any] = []
    keys = [0] * len(messages)
    short: list[tuple[int, list[np.ndarray]]] = []  # (group index, arrays) of the current batch
    short_tokens = 0
    for g, frames in enumerate(messages):
        try:
            header, episodes, routed = _parse(frames, max_bytes)
        except WireError as exc:
            results.append(exc)
            continue
        results.append((header, episodes, routed))
        for i, arrays in enumerate(episodes):
            n = len(arrays[0])
            if n > SHORT_EPISODE:
                try:
                    _check_values(i, arrays)
                except WireError as exc:
                    results[g] = exc
                    break
                keys[g] = max(keys[g], _generated_key(arrays[3], arrays[1]))
            elif n:
                short.append((g, arrays))
                short_tokens += n
                if short_tokens >= SHORT_BATCH:
                    _short_keys(short, results, keys)
                    short, short_tokens = [], 0
    _short_keys(short, results, keys)
    return [
        item if isinstance(item, WireError) else (_build(*item), _min_version(keys[g]))
        for g, item in enumerate(results)
    ]


def _short_keys(short: list[tuple[int, list[np.ndarray]]], results: list[Any], keys: list[int]) -> None:
    """Check the values of a batch of short episodes and raise their groups' keys."""
    if not short:
        return
    mask = np.concatenate([arrays[1] for _, arrays in short])
    versions = np.concatenate([arrays[3] for _, arrays in short])
    if _MAX_MASK(mask) > 1 or _MIN_VERSION(versions) < -1:  # rare: say which groups, keep the others
        _find_bad_values(results, short)
        short = [(g, arrays) for g, arrays in short if not isinstance(results[g], WireError)]
        _short_keys(short, results, keys)
        return
    starts = list(itertools.accumulate((len(arrays[0]) for _, arrays in short[:-1]), initial=0))
    episode_keys = np.maximum.reduceat(_token_keys(versions, mask), starts).tolist()
    for (g, _), key in zip(short, episode_keys, strict=True):
        if key > keys[g]:
            keys[g] = key


def _find_bad_values(results: list[Any], short: list[tuple[int, list[np.ndarray]]]) -> None:
    for g in sorted({g for g, _ in short}):
        if isinstance(results[g], WireError):
            continue
        try:
            for i, arrays in enumerate(results[g][1]):
                _check_values(i, arrays)
        except WireError as exc:
            results[g] = exc
