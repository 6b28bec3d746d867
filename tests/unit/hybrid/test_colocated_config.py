"""`colocated.t` / `colocated.tg`: the layouts the HybridEngine runs, bad ones refused at load."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.config import ColocatedConfig


@pytest.mark.parametrize(
    ("n", "t", "tg"), [(2, 1, 1), (2, 1, 2), (2, 2, 2), (2, 2, 1), (4, 2, 2), (4, 2, 1), (4, 4, 2), (4, 1, 4)]
)
def test_supported_layouts_load(n: int, t: int, tg: int) -> None:
    cfg = ColocatedConfig(num_processes=n, t=t, tg=tg)
    assert (cfg.t, cfg.tg) == (t, tg)


@pytest.mark.parametrize(
    ("n", "t", "tg", "message"),
    [
        (4, 3, 1, r"colocated.t=3 must divide colocated.num_processes=4"),
        (4, 1, 3, r"colocated.tg=3 must divide colocated.num_processes=4"),
        (4, 2, 4, r"colocated.tg=4 above colocated.t=2"),
        (6, 3, 2, r"colocated.tg=2 must divide colocated.t=3"),
        (2, 0, 1, r"greater than or equal to 1"),
    ],
)
def test_bad_layouts_are_refused(n: int, t: int, tg: int, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ColocatedConfig(num_processes=n, t=t, tg=tg)
