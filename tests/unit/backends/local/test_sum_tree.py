"""SumTree, the local backend's prioritized sampler structure, checked against numpy.

Sums and prefix-sum lookups are compared with `np.sum`, `np.cumsum` and `np.searchsorted`;
sampling by uniform targets follows the weights within a 5-sigma bound per slot (fixed seed).
The tree stores any float it is given: refusing NaN, infinite and negative priorities is done
before a table is reached (`replay_service.sample.priorities`), so it is not tested here.
Imports no TensorFlow, TF-Agents or Reverb (also runs under Python 3.12).
"""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.backends.local.sum_tree import SumTree

pytestmark = pytest.mark.local


def filled(weights: np.ndarray) -> SumTree:
    """A tree over `len(weights)` slots holding `weights`."""
    tree = SumTree(len(weights))
    tree.set(np.arange(len(weights)), weights)
    return tree


def reference_find(weights: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The slot whose range `[cumsum before it, cumsum through it)` holds each target."""
    return np.searchsorted(np.cumsum(weights), targets, side="right")


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8, 9, 1000, 1024, 1025])
def test_total_get_and_find_equal_numpys_on_integer_weights(capacity):
    rng = np.random.default_rng(capacity)
    weights = rng.integers(1, 100, capacity).astype(np.float64)  # exact in float64
    tree = filled(weights)
    assert tree.total == weights.sum()
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), weights)
    # Every boundary of every slot's range, its midpoint and the largest target below the total.
    cumsum = np.cumsum(weights)
    targets = np.concatenate(
        [[0.0], cumsum[:-1], cumsum - weights / 2, [np.nextafter(weights.sum(), 0)]]
    )
    np.testing.assert_array_equal(tree.find(targets), reference_find(weights, targets))


def test_total_matches_numpy_after_many_batches_of_updates():
    capacity = 777
    rng = np.random.default_rng(1)
    tree = SumTree(capacity)
    weights = np.zeros(capacity)
    for _ in range(300):
        slots = rng.integers(0, capacity, rng.integers(1, 40))
        values = rng.random(len(slots)) * rng.choice([1e-6, 1.0, 1e6])
        tree.set(slots, values)
        weights[slots] = values  # numpy's rule for repeated slots: the last one wins
        np.testing.assert_allclose(tree.total, weights.sum(), rtol=1e-9)
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), weights)
    targets = rng.random(5000) * weights.sum()
    expected = reference_find(weights, targets)
    found = tree.find(targets)
    # Float sums in a different order may move a target that sits on a boundary by one slot.
    assert np.mean(found == expected) > 0.999
    assert np.all(np.abs(found - expected) <= 1)


def test_a_repeated_slot_in_one_update_keeps_its_last_weight():
    tree = SumTree(4)
    tree.set(np.array([2, 0, 2, 2]), np.array([5.0, 1.0, 7.0, 3.0]))
    assert tree.get(np.array([2]))[0] == 3.0
    assert tree.total == 4.0


def test_an_update_replaces_a_weight_and_moves_the_total():
    tree = filled(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    tree.set(np.array([1, 4]), np.array([10.0, 0.0]))
    assert tree.total == 1 + 10 + 3 + 4 + 0
    np.testing.assert_array_equal(tree.get(np.arange(5)), [1, 10, 3, 4, 0])
    np.testing.assert_array_equal(
        tree.find(np.array([0.5, 1.0, 10.99, 11.0, 17.99])), [0, 1, 1, 2, 3]
    )


def test_slots_of_weight_zero_are_never_found():
    weights = np.array([0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0])  # zeros at both ends
    tree = filled(weights)
    targets = np.linspace(0.0, np.nextafter(tree.total, 0), 10_001)
    found = tree.find(targets)
    assert set(found.tolist()) == {1, 4, 6}
    np.testing.assert_array_equal(found, reference_find(weights, targets))


def test_sampling_follows_the_weights_within_five_sigma():
    weights = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 10.0, 0.5, 0.0, 30.0, 0.25])
    tree = filled(weights)
    draws = 200_000
    rng = np.random.default_rng(0)
    targets = rng.random(draws) * tree.total
    counts = np.bincount(tree.find(targets), minlength=len(weights))
    p = weights / weights.sum()
    expected = draws * p
    sigma = np.sqrt(draws * p * (1 - p))
    assert np.all(counts[p == 0] == 0), counts
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1e-9), (counts, expected)


def test_a_capacity_of_one_is_a_single_slot():
    tree = SumTree(1)
    assert tree.total == 0.0
    tree.set(np.array([0]), np.array([2.5]))
    assert tree.total == 2.5
    np.testing.assert_array_equal(tree.find(np.array([0.0, 1.0, 2.4])), [0, 0, 0])
    tree.set(np.array([0]), np.array([0.0]))
    assert tree.total == 0.0


@pytest.mark.parametrize("capacity", [2, 8, 9, 1025])
def test_the_first_and_last_slot_alone_take_every_draw(capacity):
    for slot in (0, capacity - 1):
        tree = SumTree(capacity)
        tree.set(np.array([slot]), np.array([1.5]))
        assert tree.total == 1.5
        targets = np.linspace(0.0, np.nextafter(1.5, 0), 101)
        np.testing.assert_array_equal(tree.find(targets), np.full(101, slot))


def test_an_empty_tree_has_total_zero_and_zero_weights():
    tree = SumTree(100)
    assert tree.total == 0.0
    np.testing.assert_array_equal(tree.get(np.arange(100)), np.zeros(100))
