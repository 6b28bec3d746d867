"""Each advantage estimator against a small example computed by hand."""

import math

import numpy as np
import pytest

from agentrl.learner.advantages import compute_advantages, dr_grpo, grpo, reinforce_pp, rloo


def test_grpo_hand_example():
    # rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(1/3) = 0.57735
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    np.testing.assert_allclose(grpo([np.array([1.0, 0.0, 0.0, 1.0])])[0], [a, -a, -a, a], rtol=1e-12)


def test_grpo_uniform_group_and_singleton_are_zero():
    a, b = grpo([np.array([2.0, 2.0, 2.0]), np.array([5.0])])
    np.testing.assert_array_equal(a, 0.0)
    np.testing.assert_array_equal(b, 0.0)


def test_dr_grpo_has_no_std_division():
    np.testing.assert_allclose(dr_grpo([np.array([3.0, 1.0, 2.0])])[0], [1.0, -1.0, 0.0])


def test_rloo_leave_one_out():
    # r = 1, 2, 6: baselines mean(2,6)=4, mean(1,6)=3.5, mean(1,2)=1.5
    np.testing.assert_allclose(rloo([np.array([1.0, 2.0, 6.0])])[0], [-3.0, -1.5, 4.5])


def test_reinforce_pp_normalises_over_the_batch():
    # all rewards 0, 1, 2, 3: mean 1.5, sample std 1.290994
    out = reinforce_pp([np.array([0.0, 1.0]), np.array([2.0, 3.0])])
    std = np.std([0, 1, 2, 3], ddof=1)
    np.testing.assert_allclose(np.concatenate(out), (np.array([0, 1, 2, 3]) - 1.5) / (std + 1e-8))
    # unlike GRPO, a group's advantages depend on the other groups
    assert out[0].mean() < 0 < out[1].mean()


def test_dispatch_and_unknown_name():
    r = [np.array([1.0, 0.0])]
    np.testing.assert_allclose(compute_advantages("rloo", r)[0], [1.0, -1.0])
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("ppo", r)
