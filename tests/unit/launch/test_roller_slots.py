"""`agentrl scale --rollers`: which roller indices stop and which start, as both launchers apply it."""

from agentrl.launch.control import roller_slots


def test_scaling_down_stops_the_highest_first() -> None:
    assert roller_slots([0, 1, 2], 1) == ([2, 1], [])


def test_scaling_up_starts_after_the_highest_even_past_a_gap() -> None:
    assert roller_slots([0, 2], 4) == ([], [3, 4])


def test_from_none_the_first_index_is_zero_and_no_change_is_none() -> None:
    assert roller_slots([], 2) == ([], [0, 1])
    assert roller_slots([0, 1], 2) == ([], [])
