"""n-step targets against a plain-Python reference, and n-step transitions from a real table."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tree
from tf_agents.trajectories import time_step as ts

from conftest import all_items
from replay_service import ConfigError, SamplingConfig, SpecMismatchError
from replay_service.sample.nstep import n_step_targets, windows_to_n_step
from replay_service.specs.nests import table_signature

FIRST, MID, LAST = (int(s) for s in (ts.StepType.FIRST, ts.StepType.MID, ts.StepType.LAST))
GAMMA = 0.9
TERMINATED, TRUNCATED, ONGOING = "terminated", "truncated", "ongoing"


def _episode_steps(rewards: list[float], end: str) -> list[dict[str, float]]:
    """TF-Agents steps of one episode: its transitions, then the boundary step if it ended."""
    steps = []
    for t, r in enumerate(rewards):
        last = t == len(rewards) - 1 and end != ONGOING
        steps.append(
            {
                "step_type": FIRST if t == 0 else MID,
                "next_step_type": LAST if last else MID,
                "reward": r,
                "discount": 0.0 if last and end == TERMINATED else 1.0,
            }
        )
    if end != ONGOING:
        steps.append({"step_type": LAST, "next_step_type": FIRST, "reward": 0.0, "discount": 1.0})
    return steps


def _reference(steps: list[dict[str, float]], n: int, gamma: float):
    """Per start: (return, bootstrap discount, m, valid), by explicit loops."""
    out = []
    for t, step in enumerate(steps):
        if step["step_type"] == LAST:
            out.append((0.0, 0.0, 0, False))
            continue
        ret, disc, m, ended = 0.0, 1.0, 0, False
        k = t
        while m < n and k + 1 < len(steps):
            ret += disc * steps[k]["reward"]
            disc *= gamma * steps[k]["discount"]
            m += 1
            if steps[k]["next_step_type"] == LAST:
                ended = True
                break
            k += 1
        valid = m > 0 and (m == n or ended)
        out.append((ret, disc, m, valid) if valid else (0.0, 0.0, 0, False))
    return out


def _columns(steps):
    return [np.array([s[f] for s in steps]) for f in ("reward", "discount")] + [
        np.array([s[f] for s in steps], np.int32) for f in ("step_type", "next_step_type")
    ]


EPISODES = {
    "mid_episode": [([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], ONGOING)],
    "termination_within_n": [([1.0, -2.0, 3.0, 0.5, 4.0], TERMINATED)],
    "truncation_within_n": [([2.0, 1.0, -1.0, 3.0], TRUNCATED)],
    "shorter_than_n": [([5.0, 7.0], TERMINATED)],
    "two_episodes": [([1.0, 2.0, 3.0], TRUNCATED), ([4.0, 5.0, 6.0, 7.0], TERMINATED)],
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("case", sorted(EPISODES))
def test_n_step_targets_match_the_loop_reference(case, n):
    steps = [s for rewards, end in EPISODES[case] for s in _episode_steps(rewards, end)]
    targets = n_step_targets(*_columns(steps), n=n, gamma=GAMMA)
    expected = list(zip(*_reference(steps, n, GAMMA), strict=True))
    np.testing.assert_allclose(targets.returns, expected[0], rtol=1e-12)
    np.testing.assert_allclose(targets.discounts, expected[1], rtol=1e-12)
    np.testing.assert_array_equal(targets.num_steps, expected[2])
    np.testing.assert_array_equal(targets.valid, expected[3])


def test_termination_stops_bootstrapping_and_truncation_keeps_it():
    terminated = _episode_steps([1.0, 1.0], TERMINATED)
    truncated = _episode_steps([1.0, 1.0], TRUNCATED)
    term = n_step_targets(*_columns(terminated), n=3, gamma=0.5)
    trunc = n_step_targets(*_columns(truncated), n=3, gamma=0.5)
    np.testing.assert_allclose(term.returns[:2], [1.5, 1.0])
    np.testing.assert_allclose(term.discounts[:2], [0.0, 0.0])
    np.testing.assert_allclose(trunc.returns[:2], [1.5, 1.0])
    np.testing.assert_allclose(trunc.discounts[:2], [0.25, 0.5])
    np.testing.assert_array_equal(trunc.num_steps, [2, 1, 0])
    assert not term.valid[2] and not trunc.valid[2]  # the boundary step starts nothing


def test_batched_rows_are_independent():
    a = _episode_steps([1.0, 2.0, 3.0, 4.0], TERMINATED)
    b = _episode_steps([4.0, 3.0, 2.0, 1.0], TRUNCATED)
    batched = n_step_targets(
        *(np.stack(p) for p in zip(_columns(a), _columns(b), strict=True)), n=2, gamma=0.8
    )
    for row, steps in enumerate((a, b)):
        single = n_step_targets(*_columns(steps), n=2, gamma=0.8)
        np.testing.assert_allclose(batched.returns[row], single.returns)
        np.testing.assert_allclose(batched.discounts[row], single.discounts)


@pytest.mark.parametrize(
    ("n", "gamma", "message"),
    [
        (0, 0.9, "n must be an integer >= 1, got 0"),
        (2.0, 0.9, "n must be an integer >= 1, got 2.0"),
        (2, 1.5, "gamma must be a number in [0, 1], got 1.5"),
        (2, -0.1, "gamma must be a number in [0, 1], got -0.1"),
    ],
)
def test_bad_n_or_gamma_is_refused_with_the_value(n, gamma, message):
    steps = _columns(_episode_steps([1.0, 2.0], TERMINATED))
    with pytest.raises(ConfigError, match=re.escape(message)):
        n_step_targets(*steps, n=n, gamma=gamma)


def test_mismatched_shapes_are_refused():
    rewards, discounts, step_types, next_step_types = _columns(_episode_steps([1.0], TERMINATED))
    with pytest.raises(
        SpecMismatchError, match=re.escape("got rewards [2], discounts [1], step_types [2]")
    ):
        n_step_targets(rewards, discounts[:1], step_types, next_step_types, n=1, gamma=0.9)


def _obs(episode: int, t: int) -> np.ndarray:
    return np.array([episode, t, 0, 0], np.float32)


EPISODE_REWARDS = {
    0: ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], TERMINATED),
    1: ([3.0, -1.0, 2.0, 0.5, 1.0], TRUNCATED),
}


def _window_batch(make_manager, n: int):
    """Writes the hand-made episodes to a table of n + 1 step windows; returns every item."""
    manager = make_manager(sequence_length=n + 1, sampling=SamplingConfig(sampler="uniform"))
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for episode, (rewards, end) in EPISODE_REWARDS.items():
        for t, reward in enumerate(rewards):
            last = t == len(rewards) - 1
            writer.add(
                _obs(episode, t),
                np.int64(t % 2),
                np.float32(reward),
                _obs(episode, t + 1),
                done=last and end == TERMINATED,
                truncated=last and end == TRUNCATED,
            )
    writer.flush()
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    signature = table_signature(manager.data_spec, n + 1)
    stacked = [np.stack(column) for column in zip(*items.values(), strict=True)]
    return tree.unflatten_as(signature, stacked)


def _expected_by_start(n: int) -> dict[tuple[int, int], tuple[float, float, int]]:
    expected = {}
    for episode, (rewards, end) in EPISODE_REWARDS.items():
        for t, (ret, disc, m, valid) in enumerate(
            _reference(_episode_steps(rewards, end), n, GAMMA)
        ):
            if valid:
                expected[(episode, t)] = (ret, disc, m)
    return expected


def _check_transitions(batch, expected, n):
    states = np.asarray(batch.states)
    got = {}
    for i, (episode, t) in enumerate(states[:, :2].astype(int).tolist()):
        assert (episode, t) not in got, f"transition {(episode, t)} returned twice"
        got[(episode, t)] = i
        np.testing.assert_allclose(batch.returns[i], expected[(episode, t)][0], rtol=1e-6)
        np.testing.assert_allclose(batch.discounts[i], expected[(episode, t)][1], rtol=1e-6)
        m = expected[(episode, t)][2]
        assert int(batch.num_steps[i]) == m
        np.testing.assert_array_equal(np.asarray(batch.next_states)[i], _obs(episode, t + m))
        assert int(np.asarray(batch.actions)[i]) == t % 2
    return got


def test_windows_give_one_full_n_step_transition_per_item(make_manager):
    n = 3
    trajectory = _window_batch(make_manager, n)
    batch = windows_to_n_step(trajectory, n=n, gamma=GAMMA)
    expected = _expected_by_start(n)
    got = _check_transitions(batch, expected, n)
    # Every item starts one full n-step transition; the last n - 1 of each episode start none.
    assert len(got) == trajectory.reward.shape[0] == len(expected) - 2 * (n - 1)
    assert all(int(m) == n for m in batch.num_steps)
    np.testing.assert_array_equal(np.sort(batch.item_index), np.arange(len(got)))


def test_episode_tails_make_every_transition_appear_exactly_once(make_manager):
    n = 3
    trajectory = _window_batch(make_manager, n)
    batch = windows_to_n_step(trajectory, n=n, gamma=GAMMA, include_episode_tails=True)
    expected = _expected_by_start(n)
    got = _check_transitions(batch, expected, n)
    assert set(got) == set(expected)
    assert sum(len(rewards) for rewards, _ in EPISODE_REWARDS.values()) == len(got)
    # The terminated episode's tail does not bootstrap; the truncated one's does.
    assert batch.discounts[got[(0, 5)]] == 0.0
    np.testing.assert_allclose(batch.discounts[got[(1, 4)]], GAMMA)


def test_torch_windows_give_the_same_transitions(make_manager):
    n = 2
    trajectory = _window_batch(make_manager, n)
    as_numpy = windows_to_n_step(trajectory, n=n, gamma=GAMMA, include_episode_tails=True)
    as_torch = windows_to_n_step(
        tree.map_structure(torch.from_numpy, trajectory),
        n=n,
        gamma=GAMMA,
        include_episode_tails=True,
    )
    assert isinstance(as_torch.returns, torch.Tensor)
    assert isinstance(as_torch.next_states, torch.Tensor)
    for field in ("states", "actions", "returns", "discounts", "next_states", "num_steps"):
        np.testing.assert_array_equal(getattr(as_torch, field).numpy(), getattr(as_numpy, field))


def test_windows_of_the_wrong_length_are_refused(make_manager):
    trajectory = _window_batch(make_manager, 2)
    with pytest.raises(ConfigError, match="n \\+ 1 = 4 steps.*got 3"):
        windows_to_n_step(trajectory, n=3, gamma=GAMMA)
