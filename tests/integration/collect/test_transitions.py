"""TransitionWriter: gymnasium-style collection into the table TF-Agents learners read."""

from __future__ import annotations

import itertools

import gym
import numpy as np
import pytest
import tensorflow as tf
import torch
from gym.envs.classic_control import CartPoleEnv
from gym.wrappers import TimeLimit
from tf_agents.trajectories import policy_step
from tf_agents.trajectories import time_step as ts
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import all_items
from replay_service import ManagerClosedError, SpecMismatchError
from replay_service.collect.transition_steps import FIRST, LAST, MID, Batch
from replay_service.specs.nests import flatten_with_paths, table_signature

TERMINATED, TRUNCATED = "terminated", "truncated"


def _obs(env: int, episode: int, t: int) -> np.ndarray:
    return np.array([env, episode, t, 0], np.float32)


def _records(manager) -> list[dict[str, np.ndarray]]:
    """Every item of the table as `{field path: array}`."""
    paths = [p for p, _ in flatten_with_paths(table_signature(manager.data_spec, 2))]
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    return [dict(zip(paths, data, strict=True)) for data in items.values()]


def _canonical(records) -> list[tuple[bytes, ...]]:
    return sorted(tuple(np.ascontiguousarray(r[k]).tobytes() for k in sorted(r)) for r in records)


def _episode(env: int, episode: int, length: int, end: str | None):
    """Transitions `(s, a, r, s', done, truncated, final)` of one hand-made episode."""
    out = []
    for t in range(length):
        last = t == length - 1 and end is not None
        out.append(
            (
                _obs(env, episode, t),
                np.int64(t % 2),
                np.float32(10 * env + t + 1),
                _obs(env, episode, t + 1),
                last and end == TERMINATED,
                last and end == TRUNCATED,
            )
        )
    return out


def _tf_agents_steps(transitions, end: str | None):
    """The trajectories a TF-Agents driver gives the observer for the same episode."""
    states = [ts.restart(transitions[0][0])]
    for index, (_, _, reward, next_state, *_) in enumerate(transitions):
        if index == len(transitions) - 1 and end == TERMINATED:
            states.append(ts.termination(next_state, reward))
        elif index == len(transitions) - 1 and end == TRUNCATED:
            states.append(ts.truncation(next_state, reward))
        else:
            states.append(ts.transition(next_state, reward))
    actions = [t[1] for t in transitions]
    if end is not None:
        states.append(ts.restart(np.zeros(4, np.float32)))
        actions.append(np.int64(0))
    return [
        tf.nest.map_structure(
            np.asarray,
            trajectory_lib.from_transition(current, policy_step.PolicyStep(a, (), ()), following),
        )
        for current, a, following in zip(states[:-1], actions, states[1:], strict=True)
    ]


def test_add_writes_exactly_what_the_tf_agents_observer_writes(make_manager, tmp_path):
    episodes = [(4, TERMINATED), (3, TRUNCATED), (1, TERMINATED), (3, None)]
    by_writer = make_manager(checkpoint_dir=str(tmp_path / "writer"))
    by_writer.create_replay_buffer()
    writer = by_writer.transition_writer()
    by_observer = make_manager(checkpoint_dir=str(tmp_path / "observer"))
    _, observer = by_observer.create_replay_buffer()
    for number, (length, end) in enumerate(episodes):
        transitions = _episode(0, number, length, end)
        for state, action, reward, next_state, done, truncated in transitions:
            writer.add(state, action, reward, next_state, done, truncated)
        for step in _tf_agents_steps(transitions, end):
            observer(step)
    writer.flush()
    observer.flush()
    # Closed episodes give one item per transition; the open one, one fewer.
    assert by_writer.num_frames() == 4 + 3 + 1 + 2
    assert _canonical(_records(by_writer)) == _canonical(_records(by_observer))


def _vector_run(calls: int, ends: dict[tuple[int, int], str], final_calls: set[int]):
    """Hand-made add_multi calls for 2 auto-resetting envs, and the items they must give.

    Args:
      calls: Number of add_multi calls.
      ends: `(env, call) -> TERMINATED | TRUNCATED` for the transitions that end an episode.
      final_calls: Calls that pass `final_states`.
    """
    envs = 2
    episode, t = [0, 0], [0, 0]
    arguments, steps = [], {(e, 0): [] for e in range(envs)}
    for call in range(calls):
        states, actions, rewards, nexts, dones, truncs, finals = [], [], [], [], [], [], []
        for env in range(envs):
            end = ends.get((env, call))
            state, action, reward = _obs(env, episode[env], t[env]), np.int64(t[env] % 2), 1.0
            reward = float(10 * env + t[env] + 1)
            final = _obs(env, episode[env], t[env] + 1)
            step_type = FIRST if t[env] == 0 else MID
            discount = 0.0 if end == TERMINATED else 1.0
            key = (env, episode[env])
            steps[key].append((step_type, state, action, LAST if end else MID, reward, discount))
            if end:
                boundary = final if call in final_calls else np.zeros(4, np.float32)
                steps[key].append((LAST, boundary, np.int64(0), FIRST, 0.0, 1.0))
                episode[env] += 1
                t[env] = 0
                steps[(env, episode[env])] = []
                nexts.append(_obs(env, episode[env], 0))
            else:
                t[env] += 1
                nexts.append(final)
            states.append(state)
            actions.append(action)
            rewards.append(reward)
            dones.append(end == TERMINATED)
            truncs.append(end == TRUNCATED)
            finals.append(final)
        arguments.append(
            dict(
                states=np.stack(states),
                actions=np.stack(actions),
                rewards=np.array(rewards),
                next_states=np.stack(nexts),
                dones=np.array(dones),
                truncated=np.array(truncs),
                final_states=np.stack(finals) if call in final_calls else None,
            )
        )
    expected = []
    for episode_steps in steps.values():
        for first, second in itertools.pairwise(episode_steps):
            columns = list(zip(first, second, strict=True))
            expected.append(
                {
                    "step_type": np.array(columns[0], np.int32),
                    "observation": np.stack(columns[1]),
                    "action": np.array(columns[2], np.int64),
                    "next_step_type": np.array(columns[3], np.int32),
                    "reward": np.array(columns[4], np.float32),
                    "discount": np.array(columns[5], np.float32),
                }
            )
    return arguments, expected


def test_add_multi_keeps_envs_and_episodes_apart_across_auto_resets(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    ends = {(0, 1): TERMINATED, (1, 2): TRUNCATED, (0, 4): TERMINATED, (1, 3): TERMINATED}
    arguments, expected = _vector_run(calls=6, ends=ends, final_calls={1, 2})
    for kwargs in arguments:
        writer.add_multi(**kwargs)
    writer.flush()
    assert writer.num_envs == 2
    records = _records(manager)
    assert _canonical(records) == _canonical(expected)
    for record in records:
        env, episode = record["observation"][0, :2]
        # Windows stay inside one env's episode; a boundary observation never known is zeros.
        assert record["step_type"][1] != FIRST and record["step_type"][0] != LAST
        boundary_unknown = record["step_type"][1] == LAST and not record["observation"][1].any()
        if not boundary_unknown:
            np.testing.assert_array_equal(record["observation"][1, :2], [env, episode])


@pytest.mark.heavy
def test_add_multi_with_a_gym_vector_env_feeds_tf_agents_and_torch_learners(make_manager):
    num_envs, steps = 3, 60
    envs = gym.vector.SyncVectorEnv([lambda: TimeLimit(CartPoleEnv(), 16)] * num_envs)
    states = envs.reset(seed=0)
    envs.action_space.seed(0)
    manager = make_manager()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    terminations = truncations = 0
    open_transitions = np.zeros(num_envs, int)
    for _ in range(steps):
        actions = envs.action_space.sample()
        next_states, rewards, done, infos = envs.step(actions)
        truncated = np.array([info.get("TimeLimit.truncated", False) for info in infos])
        finals = np.stack(
            [info.get("terminal_observation", np.zeros(4, np.float32)) for info in infos]
        )
        writer.add_multi(
            torch.from_numpy(states),
            torch.from_numpy(actions),
            torch.from_numpy(rewards),
            torch.from_numpy(next_states),
            torch.from_numpy(done & ~truncated),
            torch.from_numpy(truncated),
            final_states=torch.from_numpy(finals),
        )
        terminations += np.count_nonzero(done & ~truncated)
        truncations += np.count_nonzero(truncated)
        open_transitions = np.where(done, 0, open_transitions + 1)
        states = next_states
    writer.flush()
    # Every transition is in one item except the first of each env's open episode.
    assert manager.num_frames() == num_envs * steps - np.count_nonzero(open_transitions)
    trajectories, _ = next(iter(manager.get_dataset(batch_size=8, num_steps=2)))
    assert trajectories.observation.shape == [8, 2, 4]
    ends = [r for r in _records(manager) if r["next_step_type"][0] == LAST]
    assert sum(r["discount"][0] == 0 for r in ends) == terminations > 0
    assert sum(r["discount"][0] == 1 for r in ends) == truncations > 0
    with manager.torch_batches(64, transitions=True) as stream:
        batch = next(stream)
    assert batch.states.shape == batch.next_states.shape == (64, 4)
    assert not torch.any(batch.dones & batch.truncated)


def test_bad_input_is_refused_naming_the_field_and_writes_nothing(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    single = manager.transition_writer()
    s0, s1 = _obs(0, 0, 0), _obs(0, 0, 1)
    with pytest.raises(
        SpecMismatchError, match=r"'state': expected float32\[4\], got float32\[5\]"
    ):
        single.add(np.zeros(5, np.float32), 1, 1.0, s1, False)
    with pytest.raises(SpecMismatchError, match="'action': expected dtype int64, got float64"):
        single.add(s0, 1.5, 1.0, s1, False)
    with pytest.raises(SpecMismatchError, match="'reward' must be finite, got nan"):
        single.add(s0, 1, float("nan"), s1, False)
    with pytest.raises(SpecMismatchError, match="'done' must be booleans"):
        single.add(s0, 1, 1.0, s1, 2)
    with pytest.raises(SpecMismatchError, match="'hidden' was given"):
        single.add(s0, 1, 1.0, s1, False, hidden=np.zeros(3))
    single.add(s0, 1, 1.0, s1, False)
    with pytest.raises(SpecMismatchError, match="'state' is not the next_state"):
        single.add(s0, 1, 1.0, s1, False)
    with pytest.raises(SpecMismatchError, match="add_multi"):
        single.add_multi(s0[None], [1], [1.0], s1[None], [False])
    single.add(s1, 0, 1.0, _obs(0, 0, 2), True)
    single.flush()
    assert manager.num_frames() == 2

    multi = manager.transition_writer()
    states, nexts = np.stack([s0, s0]), np.stack([s1, s1])
    with pytest.raises(SpecMismatchError, match=r"batch sizes differ: .*actions 3"):
        multi.add_multi(states, [1, 1, 1], [1.0, 1.0], nexts, [False, False])
    with pytest.raises(SpecMismatchError, match=r"'rewards' must be finite, got inf \(env 1\)"):
        multi.add_multi(states, [1, 1], [1.0, np.inf], nexts, [False, False])
    with pytest.raises(SpecMismatchError, match=r"envs \[1\] were truncated.*final_states"):
        multi.add_multi(states, [1, 1], [1.0, 1.0], nexts, [False, False], [False, True])
    with pytest.raises(SpecMismatchError, match="leading batch dimension"):
        multi.add_multi(s0, 1, 1.0, s1, False)
    multi.add_multi(states, [1, 1], [1.0, 1.0], nexts, [False, False])
    with pytest.raises(SpecMismatchError, match="collects from 2 envs.*batch of 3"):
        multi.add_multi(np.stack([s1] * 3), [1] * 3, [1.0] * 3, np.stack([s1] * 3), [0, 0, 0])
    with pytest.raises(SpecMismatchError, match=r"'states' of envs \[0\] is not the next_state"):
        multi.add_multi(np.stack([s0, s1]), [1, 1], [1.0, 1.0], nexts, [False, False])
    multi.reset(0)
    multi.add_multi(np.stack([s0, s1]), [1, 1], [1.0, 1.0], nexts, [True, False])
    multi.flush()
    assert manager.num_frames() == 2 + 2


def test_checkpoint_flushes_and_close_closes_the_writer(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for t in range(5):
        writer.add(_obs(0, 0, t), 0, 1.0, _obs(0, 0, t + 1), False)
    manager.checkpoint()
    manager.close()
    with pytest.raises(ManagerClosedError, match="closed"):
        writer.add(_obs(0, 0, 5), 0, 1.0, _obs(0, 0, 6), False)
    reloaded = make_manager()
    reloaded.load_replay_buffer()
    assert reloaded.num_frames() == 4


def test_calls_after_a_good_one_are_still_checked_and_refused_whole(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    single = manager.transition_writer()
    single.add(_obs(0, 0, 0), np.int64(0), 1.0, _obs(0, 0, 1), False)
    s1, s2 = _obs(0, 0, 1), _obs(0, 0, 2)
    refused = [
        ((np.zeros(5, np.float32), 1, 1.0, s2, False), r"'state': expected float32\[4\]"),
        ((s1, 1.5, 1.0, s2, False), "'action': expected dtype int64, got float64"),
        ((s1, np.int64(1), float("nan"), s2, False), "'reward' must be finite, got nan"),
        ((s1, np.int64(1), np.float32(np.inf), s2, True), "'reward' must be finite, got inf"),
        ((s1, np.int64(1), 1.0, s2[None], True), r"'next_state': expected float32\[4\]"),
        ((s1, np.int64(1), 1.0, s2.astype(complex), True), "'next_state': expected dtype"),
        ((s1, np.int64(1), 1.0, s2, 2), "'done' must be booleans"),
        ((s2, np.int64(1), 1.0, s2, True), "'state' is not the next_state"),
    ]
    for arguments, message in refused:
        with pytest.raises(SpecMismatchError, match=message):
            single.add(*arguments)
    with pytest.raises(SpecMismatchError, match="'hidden' was given"):
        single.add(s1, np.int64(1), 1.0, s2, False, hidden=np.zeros(3))
    # Equal values in other types and signed zeros continue the episode.
    single.add(s1.astype(np.float64), 1, np.float32(1.0), s2, np.bool_(False), 0)
    negative_zeros = np.where(s2 == 0, np.float32(-0.0), s2)
    single.add(torch.from_numpy(negative_zeros), torch.tensor(0), 1, _obs(0, 0, 3), True)
    single.flush()
    assert manager.num_frames() == 3  # the boundary step ends the episode's last window

    multi = manager.transition_writer()
    states, nexts = np.stack([s1, s2]), np.stack([s2, s1])
    multi.add_multi(states, np.zeros(2, np.int64), np.ones(2, np.float32), nexts, [False] * 2)
    actions, rewards, flags = np.zeros(2, np.int64), np.ones(2, np.float32), np.zeros(2, bool)
    bad_calls = [
        ((nexts[:, :3], actions, rewards, states, flags), r"'states': expected float32\[2, 4\]"),
        ((nexts, actions[:1], rewards, states, flags), r"batch sizes differ"),
        ((nexts, actions, rewards * np.nan, states, flags), r"'rewards' must be finite"),
        ((nexts, actions, rewards, states, flags, np.array([False, True])), "were truncated"),
        ((states, actions, rewards, nexts, flags), r"'states' of envs \[0, 1\] is not"),
        ((nexts, actions, rewards, states, np.array([0, 3])), "'dones' must be booleans"),
    ]
    for arguments, message in bad_calls:
        with pytest.raises(SpecMismatchError, match=message):
            multi.add_multi(*arguments)
    multi.add_multi(nexts, [1, 1], [1.0, 1.0], states, np.array([1, 0]), final_states=nexts)
    multi.flush()
    assert manager.num_frames() == 3 + 3


def test_nested_observations_and_policy_info_are_written_field_by_field(make_manager):
    spec = trajectory_lib.Trajectory(
        step_type=tf.TensorSpec([], tf.int32),
        observation={"pos": tf.TensorSpec([2], tf.float32), "vel": tf.TensorSpec([], tf.float32)},
        action=tf.TensorSpec([], tf.int64),
        policy_info={"logp": tf.TensorSpec([], tf.float32)},
        next_step_type=tf.TensorSpec([], tf.int32),
        reward=tf.TensorSpec([], tf.float32),
        discount=tf.TensorSpec([], tf.float32),
    )
    manager = make_manager(data_spec=spec)
    manager.create_replay_buffer()
    writer = manager.transition_writer()

    def obs(t: int) -> dict[str, np.ndarray]:
        return {"pos": np.full(2, t, np.float32), "vel": np.float32(-t)}

    for t in range(3):
        writer.add(obs(t), np.int64(t), 1.0, obs(t + 1), t == 2, hidden={"logp": np.float32(t)})
    with pytest.raises(SpecMismatchError, match="'state': structure differs"):
        writer.add({"pos": np.zeros(2, np.float32)}, 0, 1.0, obs(1), False, hidden={"logp": 0.0})
    with pytest.raises(SpecMismatchError, match=r"'hidden/logp': expected float32\[\]"):
        writer.add(obs(0), 0, 1.0, obs(1), False, hidden={"logp": np.zeros(2, np.float32)})
    writer.flush()
    paths = [p for p, _ in flatten_with_paths(table_signature(spec, 2))]
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    records = sorted(
        (dict(zip(paths, data, strict=True)) for data in items.values()),
        key=lambda r: r["observation/vel"][0],
        reverse=True,
    )
    assert len(records) == 3
    for t, record in enumerate(records):
        np.testing.assert_array_equal(record["observation/pos"], [[t] * 2, [t + 1] * 2])
        np.testing.assert_array_equal(record["policy_info/logp"], [t, t + 1 if t < 2 else 0])
        np.testing.assert_array_equal(record["action"], [t, t + 1 if t < 2 else 0])
    np.testing.assert_array_equal(records[-1]["step_type"], [MID, LAST])
    np.testing.assert_array_equal(records[-1]["discount"], [0.0, 1.0])


def test_usual_values_skip_the_full_validation_after_the_first_call(make_manager, monkeypatch):
    manager = make_manager()
    manager.create_replay_buffer()
    single, multi = manager.transition_writer(), manager.transition_writer()
    single.add(_obs(0, 0, 0), np.int64(0), 1.0, _obs(0, 0, 1), False)
    states = np.stack([_obs(0, 0, 0), _obs(1, 0, 0)])
    multi.add_multi(states, np.zeros(2, np.int64), np.ones(2), states + 1, np.zeros(2, bool))

    def refuse(*args, **kwargs):
        raise AssertionError("the full validation ran")

    monkeypatch.setattr(Batch, "build", refuse)
    single.add(_obs(0, 0, 1), np.int64(1), 1.0, _obs(0, 0, 2), False, False)
    single.add(torch.from_numpy(_obs(0, 0, 2)), torch.tensor(1), np.float32(2), _obs(0, 0, 3), True)
    multi.add_multi(
        torch.from_numpy(states + 1),
        torch.ones(2, dtype=torch.int64),
        torch.ones(2),
        states + 2,
        torch.tensor([True, False]),
        np.zeros(2, bool),
        final_states=states + 2,
    )
    single.flush()
    multi.flush()
    assert manager.num_frames() == 3 + 2 + 1
