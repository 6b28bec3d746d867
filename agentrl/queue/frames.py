"""Packing of group frames into ZeroMQ segments: small frames share one, large ones go alone.

`encode_group` gives one frame per array per episode, so the send path never copies an
array. But pyzmq spends ~10 µs per frame on a zero-copy send, which dominates for the
many small arrays of short episodes. So the queue amortises, as wire.py anticipates:
consecutive frames under `PACK_BELOW` bytes are joined into one segment (a copy that
costs less than the per-frame overhead), frames at or above it are sent as their own
segment with `copy=False`. The control frame carries every frame's length and how
many frames each segment holds; the receiver cuts the segments back into frames as
zero-copy memoryview slices and checks that the lengths add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.wire import WireError, byte_view

PACK_BELOW = 64 << 10


def pack(frames: Sequence[Any]) -> tuple[list[int], list[int], list[Any]]:
    """(frame lengths, frames per segment, segments) for a list of frames."""
    lens: list[int] = []
    counts: list[int] = []
    segments: list[Any] = []
    small: list[memoryview] = []
    for frame in frames:
        view = byte_view(frame)
        lens.append(len(view))
        if len(view) < PACK_BELOW:
            small.append(view)
            continue
        if small:
            segments.append(b"".join(small))
            counts.append(len(small))
            small = []
        segments.append(view)
        counts.append(1)
    if small:
        segments.append(b"".join(small))
        counts.append(len(small))
    return lens, counts, segments


def unpack(lens: Sequence[int], counts: Sequence[int], segments: Sequence[Any]) -> list[memoryview]:
    """The frames of `pack`, as zero-copy slices of the received segments."""
    if len(counts) != len(segments) or sum(counts) != len(lens):
        raise WireError(
            f"{len(segments)} segments / {sum(counts)} frames do not match the {len(lens)} lengths"
        )
    frames: list[memoryview] = []
    i = 0
    for count, segment in zip(counts, segments, strict=True):
        view, pos = byte_view(segment), 0
        for length in lens[i : i + count]:
            if not isinstance(length, int) or length < 0:
                raise WireError(f"frame length {length!r} is not a size")
            frames.append(view[pos : pos + length])
            pos += length
        if pos != len(view):
            raise WireError(f"segment of {len(view)} bytes does not hold its frames ({pos} bytes)")
        i += count
    return frames
