"""The side weight-update group: independent members on a real gloo group, and fast failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agentrl.inference.weight_group import dtype_name, join_group, parse_dtype
from tests.conftest import find_free_port


def test_three_members_broadcast_in_order():
    port, got, errors = find_free_port(), {}, []
    sent = [torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int64)]

    def member(rank: int) -> None:
        try:
            group = join_group("127.0.0.1", port, rank, 3, "wg-test", "gloo", 20)
            bufs = [t.clone() if rank == 0 else torch.zeros_like(t) for t in sent]
            for b in bufs:
                group.broadcast(b, 0)
            got[rank] = bufs
            group.close()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(got[rank], sent, strict=True))


def test_a_missing_member_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        join_group("127.0.0.1", find_free_port(), 0, 2, "wg-alone", "gloo", 1.5)
    assert time.monotonic() - start < 30


def test_dtype_names_round_trip_and_bad_ones_are_named():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert parse_dtype(dtype_name(dt)) == dt
    assert parse_dtype("torch.bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="outside world_size"):
        join_group("127.0.0.1", 1, 3, 2)
