"""Warm-up from any policy and weighted table mixes for PyTorch, on both backends.

Velora's `warm(agent, n_samples, num_envs)` is `manager.warm_up(env, num_steps, policy)`
(gymnasium envs and vector envs, random actions by default); `mixed_dataset`'s weighted mix of
tables is `manager.mixed_torch_batches(batch_size, weights)` for PyTorch. `GymVectorWriter.add`
takes the extras declared with `from_spaces(extras=...)`.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from replay_service import (
    BufferStateError,
    ConfigError,
    MixedSampleInfo,
    ReplayBufferManager,
    SpecMismatchError,
    TableConfig,
)

pytestmark = pytest.mark.heavy

BACKENDS = ("reverb", "local")
NUM_ENVS = 3
MAX_EPISODE_STEPS = 5  # every few steps a time-limit truncation
RECENT = "recent"
RECENT_CAPACITY = 8
SIGMAS = 5


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture()
def make(backend: str, make_from_spaces: Any) -> Callable[..., ReplayBufferManager]:
    """`from_spaces` managers of the parametrized backend (conftest's `make_from_spaces`)."""
    return functools.partial(make_from_spaces, backend)


class Recorder(gymnasium.Wrapper):
    """Records every real transition of one environment as plain Python values."""

    def __init__(self, env: gymnasium.Env, log: list[tuple[Any, ...]]) -> None:
        super().__init__(env)
        self._log = log
        self._obs: np.ndarray | None = None

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        assert self._obs is not None
        self._log.append(
            (
                tuple(self._obs.tolist()),
                int(action),
                float(reward),
                tuple(obs.tolist()),
                bool(terminated),
                bool(truncated) and not terminated,
            )
        )
        self._obs = obs
        return obs, reward, terminated, truncated, info


def cartpole(log: list[tuple[Any, ...]]) -> gymnasium.Env:
    return Recorder(gymnasium.make("CartPole-v1", max_episode_steps=MAX_EPISODE_STEPS), log)


def stored(manager: ReplayBufferManager, table: str | None = None) -> list[tuple[Any, ...]]:
    """Every stored transition once, as `Recorder` logs them."""
    out = []
    for batch in manager.epoch_batches(64, transitions=True, table=table):
        for i in range(batch.states.shape[0]):
            out.append(
                (
                    tuple(batch.states[i].tolist()),
                    int(batch.actions[i]),
                    float(batch.rewards[i]),
                    tuple(batch.next_states[i].tolist()),
                    bool(batch.dones[i]),
                    bool(batch.truncated[i]),
                )
            )
    return out


def cut_at_the_end(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """An env's log with its last transition ended as truncated (the warm-up's budget)."""
    *head, (state, action, reward, next_state, done, _) = log
    return [*head, (state, action, reward, next_state, done, not done)]


# ----------------------------------------------------------------------------------- warm-up


def test_warm_up_stores_every_transition_of_a_single_env_with_random_actions(make):
    log: list[tuple[Any, ...]] = []
    manager = make()
    manager.create_replay_buffer()
    assert manager.warm_up(cartpole(log), 23, seed=0, progress=False) == 23
    assert len(log) == 23
    # Every transition became an item, the last one too (its episode cut as truncated).
    assert len(manager) == 23
    assert Counter(stored(manager)) == Counter(cut_at_the_end(log))
    assert sum(t[5] for t in log) >= 3  # time limits were met and stored as truncations
    assert {t[1] for t in log} == {0, 1}  # random actions

    again: list[tuple[Any, ...]] = []
    other = make("again")
    other.create_replay_buffer()
    other.warm_up(cartpole(again), 23, seed=0, progress=False)
    assert again == log  # the seed fixes the env's resets and the random actions


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_warm_up_of_a_vector_env_stores_its_real_transitions(make, mode):
    logs: list[list[tuple[Any, ...]]] = [[] for _ in range(NUM_ENVS)]
    envs = SyncVectorEnv([lambda log=log: cartpole(log) for log in logs], autoreset_mode=mode)
    manager = make()
    manager.create_replay_buffer()
    written = manager.warm_up(envs, 25, seed=1, progress=False)
    assert 25 <= written < 25 + NUM_ENVS
    assert written == sum(len(log) for log in logs) == len(manager)
    expected = Counter(t for log in logs for t in cut_at_the_end(log))
    # NEXT_STEP reset steps are not stored; SAME_STEP final observations are the real ones.
    assert Counter(stored(manager)) == expected
    assert all(t[2] == 1.0 for t in expected)


def test_warm_up_takes_any_policy_with_torch_actions_and_extras(make):
    manager = make(extras={"log_prob": ((), np.float32), "hidden": ((2,), np.float32)})
    manager.create_replay_buffer()
    seen = []

    def policy(observation: np.ndarray) -> Any:
        seen.append(observation)
        value = float(observation[0])
        return torch.tensor(1), {"log_prob": -0.5, "hidden": np.array([value, 2.0], np.float32)}

    assert manager.warm_up(cartpole([]), 12, policy, seed=2, progress=False) == 12
    assert len(seen) == 12

    def vector_policy(observations: np.ndarray) -> Any:
        rows = observations.shape[0]
        hidden = np.stack([observations[:, 0], np.full(rows, 2.0, np.float32)], axis=1)
        return torch.zeros(rows, dtype=torch.int64), {
            "log_prob": np.full(rows, -1.5, np.float32),
            "hidden": hidden,
        }

    envs = SyncVectorEnv([lambda: cartpole([]) for _ in range(NUM_ENVS)])
    written = manager.warm_up(envs, 9, vector_policy, seed=3, progress=False)
    assert written == len(manager) - 12
    batches = list(manager.epoch_batches(64, transitions=True))
    actions = torch.cat([b.actions for b in batches]).reshape(-1)
    log_probs = torch.cat([b.hiddens["log_prob"] for b in batches])
    states = torch.cat([b.states for b in batches])
    hiddens = torch.cat([b.hiddens["hidden"] for b in batches])
    assert Counter(zip(actions.tolist(), log_probs.tolist(), strict=True)) == {
        (1, -0.5): 12,
        (0, -1.5): written,
    }
    # Each env's extras went with its own transition.
    torch.testing.assert_close(hiddens[:, 0], states[:, 0])


def test_warm_up_shows_progress_with_tqdm_or_log_lines(make, capsys, caplog, monkeypatch):
    manager = make()
    manager.create_replay_buffer()
    manager.warm_up(cartpole([]), 17, seed=0)
    err = capsys.readouterr().err
    assert "warm-up" in err and "17/17" in err
    manager.warm_up(cartpole([]), 5, seed=0, progress=False)
    assert "warm-up" not in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # tqdm not installed
    with caplog.at_level(logging.INFO, logger="replay_service.collect.warm_up"):
        manager.warm_up(cartpole([]), 6, seed=0)
    assert "warm-up: 6/6 transitions written" in caplog.text
    assert "warm-up" not in capsys.readouterr().err


def test_warm_up_refuses_bad_arguments_writing_nothing(make):
    manager = make()
    env = cartpole([])
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.warm_up(env, 10)
    manager.create_replay_buffer()
    for args, kwargs, match in [
        ((env, 0), {}, "num_steps must be a positive integer, got 0"),
        ((env, 2.5), {}, "num_steps must be a positive integer, got 2.5"),
        ((env, True), {}, "num_steps must be a positive integer, got True"),
        ((object(), 10), {}, "env must be a gymnasium env or vector env"),
        ((env, 10, "random"), {}, "policy must be a callable .* got 'random'"),
        ((env, 10), {"seed": -1}, "seed must be a non-negative integer or None, got -1"),
        ((env, 10), {"progress": "yes"}, "progress must be True or False, got 'yes'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            manager.warm_up(*args, **kwargs)
    # Observations of another shape than the data spec's: refused by the writer, named.
    narrow = make("narrow", observation=spaces.Box(-1, 1, (3,), np.float32))
    narrow.create_replay_buffer()
    with pytest.raises(SpecMismatchError, match=r"'state': expected float32\[3\]"):
        narrow.warm_up(env, 10, progress=False)
    assert len(narrow) == 0

    with_extras = make("extras", extras={"log_prob": ((), np.float32)})
    with_extras.create_replay_buffer()
    with pytest.raises(ConfigError, match=r"declares the extras \['log_prob'\]"):
        with_extras.warm_up(env, 10)
    with pytest.raises(SpecMismatchError, match=r"must return \(action, \{name: value\}\)"):
        with_extras.warm_up(env, 10, lambda obs: 0, progress=False)
    assert len(manager) == len(with_extras) == 0


class OldGymApi:
    """A gymnasium CartPole behind the old gym API (gym < 0.26), as `style` says: "0.21"
    (`reset()` takes no seed and returns the observation), "0.25" (`reset(seed=...)` returns
    the observation) or "mixed" (gymnasium's reset, the old 4-value step)."""

    def __init__(self, style: str) -> None:
        self._env = gymnasium.make("CartPole-v1")
        self.action_space = self._env.action_space
        self.observation_space = self._env.observation_space
        self._style = style

    def reset(self, **kwargs: Any) -> Any:
        if self._style == "0.21" and kwargs:
            raise TypeError(f"reset() got an unexpected keyword argument {next(iter(kwargs))!r}")
        obs, info = self._env.reset(**kwargs)
        return (obs, info) if self._style == "mixed" else obs

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self._env.step(action)
        return obs, reward, terminated or truncated, info


@pytest.mark.parametrize(
    "style,match",
    [
        ("0.21", r"env\.reset\(seed=\.\.\.\) of .* refused the seed: reset\(\) got an unexpected"),
        ("0.25", r"env\.reset\(\) of .* returned ndarray array\(.*\), not \(observation, info\)"),
        ("mixed", r"env\.step\(\) of .* returned a 4-tuple \(array\(.*\), 1\.0, False, \{\}\)"),
    ],
)
def test_warm_up_refuses_the_old_gym_api_naming_what_it_returned(make, style, match):
    manager = make()
    manager.create_replay_buffer()
    for seed in (0, None):
        with pytest.raises(ConfigError) as raised:
            manager.warm_up(OldGymApi(style), 10, seed=seed, progress=False)
        message = str(raised.value)
        # numpy wraps a long array's repr over lines.
        assert re.search(match, message, re.DOTALL), message
        assert "(observation, reward, terminated, truncated, info)" in message
        assert "old gym API" in message and "GymV21Environment-v0" in message
        assert "nothing" in message and len(manager) == 0
    # The buffer is untouched and takes a gymnasium env at once.
    assert manager.warm_up(cartpole([]), 10, seed=0, progress=False) == 10


def test_warm_up_refuses_an_installed_old_gym_env_and_vector_env(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gym = pytest.importorskip("gym")
    if tuple(int(p) for p in gym.__version__.split(".")[:2]) >= (0, 26):
        pytest.skip(f"gym {gym.__version__} speaks gymnasium's API")
    manager = make()
    manager.create_replay_buffer()
    single = gym.make("CartPole-v1")
    vector = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)
    for env in (single, vector):
        with pytest.raises(ConfigError, match=rf"is a gym {gym.__version__} env\. This looks like"):
            manager.warm_up(env, 10, seed=0, progress=False)
    assert len(manager) == 0


def test_gym_vector_writer_refuses_the_old_gym_step_values(make):
    manager = make()
    manager.create_replay_buffer()
    envs = SyncVectorEnv([lambda: cartpole([]) for _ in range(NUM_ENVS)])
    writer = manager.gym_vector_writer(envs)
    obs, _ = envs.reset(seed=0)
    writer.reset(obs)
    actions = np.zeros(NUM_ENVS, np.int64)
    obs, rewards, terminated, truncated, infos = envs.step(actions)
    with pytest.raises(SpecMismatchError, match=r"got four \(observations, rewards, dones, infos"):
        writer.add(actions, obs, rewards, terminated | truncated, infos)
    writer.add(actions, obs, rewards, terminated, truncated, infos, end_episodes=True)
    writer.flush()
    assert len(manager) == NUM_ENVS


# ------------------------------------------------------------- GymVectorWriter and extras


def test_gym_vector_writer_splits_extras_per_env(make):
    manager = make(extras={"hidden": ((2,), np.float32), "log_prob": ((), np.float32)})
    manager.create_replay_buffer()
    envs = SyncVectorEnv([lambda: cartpole([]) for _ in range(NUM_ENVS)])
    writer = manager.gym_vector_writer(envs)
    obs, _ = envs.reset(seed=0)
    writer.reset(obs)
    actions = np.zeros(NUM_ENVS, np.int64)
    for _ in range(4):
        hidden = np.stack([obs[:, 0], obs[:, 1]], axis=1)
        log_prob = np.arange(NUM_ENVS, dtype=np.float32)
        obs, *rest = envs.step(actions)
        writer.add(actions, obs, *rest, hidden=hidden, log_prob=log_prob)
    with pytest.raises(SpecMismatchError, match=r"extra\(s\) \['log_prob'\] required"):
        writer.add(actions, *envs.step(actions), hidden=np.zeros((NUM_ENVS, 2), np.float32))
    with pytest.raises(SpecMismatchError, match="hidden: expected a leading dimension of 3"):
        writer.add(actions, *envs.step(actions), hidden=np.zeros((2, 2)), log_prob=np.zeros(2))
    writer.flush()
    batches = list(manager.epoch_batches(64, transitions=True))
    states = torch.cat([b.states for b in batches])
    hiddens = torch.cat([b.hiddens["hidden"] for b in batches])
    torch.testing.assert_close(hiddens, states[:, :2])
    log_probs = torch.cat([b.hiddens["log_prob"] for b in batches])
    # 4 steps per env; the 4th transition waits for its episode's next step.
    assert sorted(log_probs.tolist()) == [0.0] * 3 + [1.0] * 3 + [2.0] * 3


# ----------------------------------------------------------------------- PyTorch mixing


def state(episode: int, index: int) -> np.ndarray:
    return np.array([episode, index, 0, 0], np.float32)


def write(manager: ReplayBufferManager, episodes: range, length: int) -> None:
    writer = manager.transition_writer()
    for episode in episodes:
        for i in range(length):
            writer.add(state(episode, i), i % 2, 1.0, state(episode, i + 1), i == length - 1)
    writer.flush()


def two_tables(make: Callable[..., ReplayBufferManager], **kwargs: Any) -> ReplayBufferManager:
    """The primary table with every item, and "recent" with the newest `RECENT_CAPACITY`."""
    manager = make(
        extra_tables=[TableConfig(name=RECENT, capacity=RECENT_CAPACITY, sequence_length=2)],
        **kwargs,
    )
    manager.create_replay_buffer()
    write(manager, range(5), 10)
    return manager


def keys_of(batch: Any) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in batch.states[:, :2].tolist()]


def test_mixed_torch_batches_draw_each_table_in_proportion_to_its_weight(make):
    manager = two_tables(make)
    recent = {t[0][:2] for t in stored(manager, RECENT)}
    assert len(recent) == RECENT_CAPACITY
    weights = {RECENT: 1.0, manager.table_name: 3.0}
    stream = manager.mixed_torch_batches(200, weights, seed=7, transitions=True, with_info=True)
    tables: list[int] = []
    interleaved = False
    from_primary: set[tuple[int, int]] = set()
    for _ in range(10):
        batch, info = next(stream)
        assert isinstance(info, MixedSampleInfo)
        assert batch.states.shape == (200, 4) and info.table.shape == (200,)
        assert info.key.dtype == torch.uint64 and info.table.dtype == torch.int64
        table = info.table.tolist()
        interleaved |= table != sorted(table)
        for key, index in zip(keys_of(batch), table, strict=True):
            if index == 0:
                assert key in recent, key  # a "recent" item is one of its newest items
            else:
                assert index == 1
                from_primary.add(key)
        tables += table
    stream.close()
    fraction = tables.count(0) / len(tables)
    sigma = math.sqrt(0.25 * 0.75 / len(tables))
    assert abs(fraction - 0.25) <= SIGMAS * sigma, fraction
    assert len(from_primary - recent) > 20  # the primary table's older items came too
    assert interleaved

    def tables_drawn(seed: int) -> list[list[int]]:
        mixed = manager.mixed_torch_batches(50, weights, seed=seed, with_info=True)
        drawn = [next(mixed)[1].table.tolist() for _ in range(3)]
        mixed.close()
        return drawn

    assert tables_drawn(3) == tables_drawn(3) != tables_drawn(4)

    # Weight 0 leaves a table out; positions stay those of `weights`.
    only = manager.mixed_torch_batches(
        64, {manager.table_name: 0, RECENT: 2.0}, with_info=True, transitions=True
    )
    batch, info = next(only)
    assert set(info.table.tolist()) == {1}
    assert set(keys_of(batch)) <= recent
    # Trajectories, a device and a prefetching thread, as torch_batches.
    with manager.mixed_torch_batches(16, weights, prefetch=2, device="cpu") as trajectories:
        assert next(trajectories).observation.shape == (16, 2, 4)


def test_mixed_torch_batches_drop_items_drawn_before_a_clear(make):
    manager = two_tables(make)
    stream = manager.mixed_torch_batches(
        5, {manager.table_name: 1.0, RECENT: 1.0}, seed=0, transitions=True
    )
    next(stream)
    manager.clear()
    write(manager, range(90, 91), 10)
    for _ in range(5):
        assert {episode for episode, _ in keys_of(next(stream))} == {90}


def test_mixed_torch_batches_refuse_bad_input(make):
    manager = make(
        sequence_length=2,
        extra_tables=[
            TableConfig(name=RECENT, capacity=10, sequence_length=2),
            TableConfig(name="triples", capacity=10, sequence_length=3),
        ],
    )
    primary = manager.table_name
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.mixed_torch_batches(4, {primary: 1.0})
    manager.create_replay_buffer()
    for args, kwargs, match in [
        ((4, {}), {}, "weights must be a non-empty mapping"),
        ((4, [(primary, 1.0)]), {}, "weights must be a non-empty mapping"),
        ((4, {"nope": 1.0}), {}, "nope"),
        ((4, {primary: float("nan")}), {}, f"weight of table '{primary}' must be a finite"),
        ((4, {primary: 1.0, RECENT: -1}), {}, "weight of table 'recent' must be a finite"),
        ((4, {primary: 0, RECENT: 0.0}), {}, "weights must have a positive, finite sum"),
        ((4, {primary: 1e308, RECENT: 1e308}), {}, r"positive, finite sum.*sum inf"),
        ((4, {primary: 1.0, "triples": 1.0}), {}, "one sequence_length"),
        ((0, {primary: 1.0}), {}, "batch_size must be a positive integer, got 0"),
        ((4, {primary: 1.0}), {"seed": -2}, "seed must be a non-negative integer or None"),
        ((4, {primary: 1.0}), {"seed": 1.5}, "got 1.5"),
        ((4, {primary: 1.0}), {"device": "gpu:x"}, "device must be a torch device"),
        ((4, {primary: 1.0}), {"prefetch": -1}, "prefetch must be an integer >= 0"),
        ((4, {"triples": 1.0}), {"transitions": True}, "transitions=True needs"),
    ]:
        with pytest.raises(ConfigError, match=match):
            manager.mixed_torch_batches(*args, **kwargs)
    # An empty table is named when nothing can be sampled from it within Timeouts.sample.
    stream = manager.mixed_torch_batches(4, {RECENT: 1.0}, seed=0)
    with pytest.raises(BufferStateError, match="'recent'"):
        next(stream)
