"""Prioritized replay against a real Reverb server: sampling follows priorities, updates apply."""

from __future__ import annotations

import collections
import re
import threading

import numpy as np
import pytest
import tensorflow as tf
import torch

from replay_service import ConfigError, SamplingConfig, SpecMismatchError
from replay_service.sample.priorities import (
    BetaSchedule,
    MaxPriorityTracker,
    importance_weights,
    prepare_updates,
    update_priorities,
)
from replay_service.specs.nests import flatten_with_paths

NUM_SAMPLES = 4000
# Frequencies must be within this many binomial standard deviations of the expected ones.
SIGMAS = 5.0
PRIORITIZED = SamplingConfig(sampler="prioritized", priority_exponent=1.0)


def _write_items(manager, priorities: list[float]) -> None:
    """One item (a one-transition episode, 2 steps) per priority, in order."""
    for i, priority in enumerate(priorities):
        writer = manager.transition_writer(priority=priority)
        state = np.array([i, 0, 0, 0], np.float32)
        writer.add(state, np.int64(0), np.float32(i), state + 1, done=True)
        writer.close()


def _prioritized_manager(make_manager, priorities: list[float], capacity: int = 100):
    manager = make_manager(capacity=capacity, sampling=PRIORITIZED)
    manager.create_replay_buffer()
    _write_items(manager, priorities)
    assert manager.num_frames() == min(len(priorities), capacity)
    return manager


def _sample(manager, num_samples: int = NUM_SAMPLES):
    """Returns `(keys, {key: priority}, {key: observation id})` of `num_samples` draws."""
    paths = [path for path, _ in flatten_with_paths(manager.data_spec)]
    observation = paths.index("observation")
    keys, priority, ident = [], {}, {}
    client = manager.py_client
    layout = getattr(client, "layout", None)  # the default packed layout's PackingClient
    for sample in client.sample(manager.table_name, num_samples=num_samples, emit_timesteps=False):
        key = int(sample.info.key)
        keys.append(key)
        priority[key] = float(sample.info.priority)
        data = sample.data if layout is None else layout.unpack_leaves(sample.data[0])
        ident[key] = int(np.asarray(data[observation])[0, 0])  # the item's index
    return keys, priority, ident


def _assert_frequencies(keys: list[int], expected: dict[int, float]) -> None:
    counts = collections.Counter(keys)
    for key, p in expected.items():
        sigma = np.sqrt(p * (1 - p) / len(keys))
        frequency = counts[key] / len(keys)
        assert abs(frequency - p) <= SIGMAS * sigma, (key, frequency, p)


def test_prioritized_sampling_follows_the_priorities(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 2.0, 3.0, 4.0])
    keys, priority, ident = _sample(manager)
    assert sorted(priority.values()) == [1.0, 2.0, 3.0, 4.0]
    assert all(priority[k] == ident[k] + 1 for k in priority)
    _assert_frequencies(keys, {k: p / 10.0 for k, p in priority.items()})


def test_update_priorities_changes_what_is_sampled(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 2.0, 3.0, 4.0])
    _, priority, _ = _sample(manager, 200)
    ordered = sorted(priority)
    keys = torch.tensor(np.array(ordered, np.uint64))
    assert keys.dtype == torch.uint64  # as in TorchSampleInfo.key
    reversed_priorities = torch.tensor([5.0 - priority[k] for k in ordered])
    sent = update_priorities(
        manager.py_client, manager.table_name, keys, reversed_priorities, timeout=10.0
    )
    assert sent == {k: 5.0 - priority[k] for k in ordered}
    new_keys, new_priority, _ = _sample(manager)
    assert new_priority == sent
    _assert_frequencies(new_keys, {k: p / 10.0 for k, p in sent.items()})


@pytest.mark.heavy
def test_tf_inputs_broadcast_over_time_and_repeated_keys_last_wins(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 1.0])
    _, priority, _ = _sample(manager, 100)
    first, second = sorted(priority)
    keys = tf.constant([[first, first], [second, second], [first, first]], tf.uint64)
    priorities = tf.constant([[7.0, 7.0], [3.0, 3.0], [9.0, 9.0]], tf.float64)
    sent = update_priorities(manager.py_client, manager.table_name, keys, priorities)
    assert sent == {first: 9.0, second: 3.0}
    assert _sample(manager, 100)[1] == sent


def test_updates_of_evicted_items_are_ignored(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 1.0], capacity=2)
    _, old, _ = _sample(manager, 100)
    _write_items(manager, [2.0, 3.0])  # evicts both old items (FIFO remover)
    assert manager.num_frames() == 2
    _, current, _ = _sample(manager, 100)
    assert not set(old) & set(current)
    new_key = max(current, key=current.get)
    update_priorities(
        manager.py_client,
        manager.table_name,
        np.array([*old, new_key], np.uint64),
        np.array([100.0, 100.0, 6.0]),
    )
    _, after, _ = _sample(manager, 200)
    assert manager.num_frames() == 2
    assert set(after) == set(current)
    assert after == {**current, new_key: 6.0}


@pytest.mark.heavy
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_priorities_are_refused_with_the_value_and_nothing_changes(make_manager, bad):
    manager = _prioritized_manager(make_manager, [1.0, 2.0])
    _, before, _ = _sample(manager, 100)
    keys = np.array(sorted(before), np.uint64)
    with pytest.raises(ConfigError, match=re.escape(f"key {int(keys[1])}: {bad!r}")):
        update_priorities(manager.py_client, manager.table_name, keys, np.array([5.0, bad]))
    assert _sample(manager, 100)[1] == before


def test_mismatched_keys_and_priorities_are_refused(make_manager):
    manager = _prioritized_manager(make_manager, [1.0])
    with pytest.raises(SpecMismatchError, match="2 keys and 3 priorities"):
        update_priorities(manager.py_client, manager.table_name, [1, 2], [1.0, 2.0, 3.0])
    expected = "keys must be integers in [0, 2**64), got [1.5]"
    with pytest.raises(SpecMismatchError, match=re.escape(expected)):
        update_priorities(manager.py_client, manager.table_name, [1.5], [1.0])
    with pytest.raises(SpecMismatchError, match=re.escape("got [-3]")):
        update_priorities(manager.py_client, manager.table_name, [2, -3], [1.0, 1.0])
    with pytest.raises(SpecMismatchError, match="keys must be integers, got dtype float32"):
        update_priorities(manager.py_client, manager.table_name, np.ones(1, np.float32), [1.0])


def test_python_int_keys_above_int64_are_exact():
    big = 2**63 + 5
    assert prepare_updates([3, big], [1.0, 2.0]) == {3: 1.0, big: 2.0}


def test_tracker_follows_the_largest_priority_sent(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 2.0])
    tracker = MaxPriorityTracker()
    assert tracker.value == 1.0
    _, priority, _ = _sample(manager, 100)
    keys = sorted(priority)
    update_priorities(manager.py_client, manager.table_name, keys, [8.0, 0.5], tracker=tracker)
    assert tracker.value == 8.0
    update_priorities(manager.py_client, manager.table_name, keys, [2.0, 3.0], tracker=tracker)
    assert tracker.value == 8.0  # a maximum never goes down
    with pytest.raises(ConfigError, match="nan"):
        tracker.observe([float("nan")])
    assert tracker.value == 8.0
    _write_items(manager, [tracker.value])
    assert max(_sample(manager, 200)[1].values()) == 8.0


def test_tracker_is_thread_safe():
    tracker = MaxPriorityTracker(initial=0.5)
    values = np.arange(8 * 500, dtype=np.float64).reshape(8, 500)

    def observe(row: np.ndarray) -> None:
        for value in row:
            tracker.observe([value])

    threads = [threading.Thread(target=observe, args=(row,)) for row in values]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tracker.value == values.max()


@pytest.mark.parametrize("initial", [0.0, -1.0, float("nan"), float("inf")])
def test_tracker_refuses_a_bad_initial_value(initial):
    with pytest.raises(ConfigError, match=re.escape(repr(initial))):
        MaxPriorityTracker(initial)


PROBABILITIES = [0.1, 0.2, 0.3, 0.4]
# (N * P)^-0.5 for N = 4, divided by its maximum, (4 * 0.1)^-0.5.
EXPECTED_WEIGHTS = [(4 * p) ** -0.5 / (0.4**-0.5) for p in PROBABILITIES]


def test_importance_weights_match_the_formula_for_numpy_tf_and_torch():
    np.testing.assert_allclose(
        importance_weights(np.array(PROBABILITIES), 4, 0.5), EXPECTED_WEIGHTS, rtol=1e-12
    )
    tf_weights = importance_weights(tf.constant(PROBABILITIES, tf.float64), tf.constant(4), 0.5)
    assert isinstance(tf_weights, tf.Tensor)
    np.testing.assert_allclose(tf_weights.numpy(), EXPECTED_WEIGHTS, rtol=1e-12)
    torch_weights = importance_weights(
        torch.tensor(PROBABILITIES, dtype=torch.float32), torch.full([4], 4), 0.5
    )
    assert isinstance(torch_weights, torch.Tensor) and torch_weights.dtype == torch.float32
    np.testing.assert_allclose(torch_weights.numpy(), EXPECTED_WEIGHTS, rtol=1e-6)


def test_importance_weights_of_broadcast_info_and_edge_betas():
    probabilities = np.repeat(np.array(PROBABILITIES)[:, None], 3, axis=1)
    weights = importance_weights(probabilities, np.full([4, 3], 4), 0.5)
    assert weights.shape == (4, 3)
    np.testing.assert_allclose(weights[:, 2], EXPECTED_WEIGHTS, rtol=1e-12)
    np.testing.assert_allclose(importance_weights(np.array(PROBABILITIES), 4, 0.0), 1.0)
    np.testing.assert_allclose(
        importance_weights(np.array(PROBABILITIES), 4, 1.0), [1.0, 0.5, 1 / 3, 0.25]
    )
    with pytest.raises(ConfigError, match="got 1.5"):
        importance_weights(np.array(PROBABILITIES), 4, 1.5)


@pytest.mark.heavy
def test_importance_weights_of_sampled_info(make_manager):
    manager = _prioritized_manager(make_manager, [1.0, 3.0])
    batch = next(iter(manager.get_dataset(batch_size=64)))
    info = batch[1]
    weights = importance_weights(info.probability, info.table_size, 1.0)
    expected = np.where(info.priority.numpy() == 1.0, 1.0, 1.0 / 3.0)
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-9)


def test_beta_schedule_anneals_linearly_then_stays():
    schedule = BetaSchedule(start=0.4, end=1.0, steps=100)
    assert schedule.value(0) == pytest.approx(0.4)
    assert schedule.value(50) == pytest.approx(0.7)
    assert schedule.value(100) == pytest.approx(1.0)
    assert schedule.value(10_000) == pytest.approx(1.0)
    assert BetaSchedule().value(0) == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="got -1"):
        schedule.value(-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": -0.1}, "BetaSchedule.start must be a number in [0, 1], got -0.1"),
        ({"end": 1.5}, "BetaSchedule.end must be a number in [0, 1], got 1.5"),
        ({"steps": 0}, "BetaSchedule.steps must be a positive integer, got 0"),
        ({"steps": 2.5}, "BetaSchedule.steps must be a positive integer, got 2.5"),
    ],
)
def test_beta_schedule_refuses_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        BetaSchedule(**kwargs)


@pytest.mark.heavy
def test_manager_update_priorities_changes_sampling(make_manager, env, policy):
    from conftest import collect
    from replay_service import SamplingConfig

    manager = make_manager(sampling=SamplingConfig(sampler="prioritized", priority_exponent=1.0))
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 10)
    keys = [
        s.info.key for s in manager.py_client.sample(manager.table_name, 200, emit_timesteps=False)
    ]
    favourite = int(keys[0])
    updates = {int(k): (1000.0 if int(k) == favourite else 1e-3) for k in set(map(int, keys))}
    sent = manager.update_priorities(list(updates), np.array(list(updates.values())))
    assert sent == updates
    hits = sum(
        int(s.info.key) == favourite
        for s in manager.py_client.sample(manager.table_name, 200, emit_timesteps=False)
    )
    assert hits > 150
