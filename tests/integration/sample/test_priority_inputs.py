"""Priority inputs: both backends accept and refuse the same ones, through the public API.

Each case of the table in docs/guide/sampling.md ("Priority inputs") runs on a Reverb buffer and
on a local one, each with two prioritized tables of three items (priority 1): an accepted call
shows its effect in the priorities and probabilities that sampling reports, a refused call
raises the project's error naming the value and changes no priority of either table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from conftest import FAST_TIMEOUTS
from replay_service import (
    ConfigError,
    ReplayBufferManager,
    SamplingConfig,
    SpecMismatchError,
    TableConfig,
)
from replay_service.errors import ReplayServiceError

BACKENDS = ("reverb", "local")
PRIMARY, OTHER = "main", "other"
ITEMS = 3
STEP = np.array([0, 1, 0, 0], np.float32)

pytestmark = pytest.mark.heavy


def _sampling() -> SamplingConfig:
    return SamplingConfig(sampler="prioritized", priority_exponent=1.0)


def _make(make_manager: Callable[..., Any], backend: str, directory: str) -> tuple[Any, Any]:
    """A manager of `backend` with two prioritized tables of `ITEMS` items, each at priority 1,
    and the keys of each table (sorted)."""
    manager = make_manager(
        backend=backend,
        checkpoint_dir=directory,
        capacity=50,
        table_name=PRIMARY,
        sampling=_sampling(),
        extra_tables=[TableConfig(OTHER, 50, 2, sampling=_sampling())],
    )
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for i in range(ITEMS):
        last = i == ITEMS - 1
        writer.add(STEP * i, 0, float(i), STEP * (i + 1), last, False)
    writer.flush()
    keys = {name: sorted(sampled(manager, name)) for name in (PRIMARY, OTHER)}
    assert all(len(k) == ITEMS for k in keys.values()), keys
    return manager, keys


@pytest.fixture(scope="module")
def shared_buffers(tmp_path_factory) -> Iterator[dict[str, tuple[Any, Any]]]:
    """One buffer of each backend (`_make`) for the cases that change only priorities: an
    embedded Reverb server per case cost about a second of CPU each."""
    made: list[Any] = []

    def factory(**kwargs: Any) -> Any:
        manager = ReplayBufferManager(data_spec=_data_spec(), timeouts=FAST_TIMEOUTS, **kwargs)
        made.append(manager)
        return manager

    root = tmp_path_factory.mktemp("priority_inputs")
    try:
        yield {backend: _make(factory, backend, str(root / backend)) for backend in BACKENDS}
    finally:
        for manager in made:
            manager.close()


@pytest.fixture(params=BACKENDS)
def buffer(request, shared_buffers):
    """The shared buffer of the parametrized backend, every priority of both tables set back
    to 1 first: each case starts from the same state (which its last checks, sampling both
    tables, would show otherwise)."""
    manager, keys = shared_buffers[request.param]
    for table in (PRIMARY, OTHER):
        manager.update_priorities(keys[table], [1.0] * ITEMS, table=table)
    return manager, keys


@pytest.fixture(params=BACKENDS)
def fresh_buffer(request, make_manager, tmp_path):
    """A buffer of its own (`_make`), for the cases that add items or close it."""
    return _make(make_manager, request.param, str(tmp_path / request.param))


def _data_spec() -> Any:
    """CartPole's per-step Trajectory spec (the `data_spec` fixture's)."""
    from tf_agents.environments import suite_gym
    from tf_agents.policies import random_py_policy

    from replay_service.specs.nests import collect_data_spec

    env = suite_gym.load("CartPole-v0")
    policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)
    return collect_data_spec(env, policy)


def sampled(manager: Any, table: str) -> dict[int, tuple[float, float]]:
    """Key -> (priority, probability) of every item sampling drew from `table` (400 draws)."""
    seen: dict[int, tuple[float, float]] = {}
    with manager.torch_batches(100, with_info=True, prefetch=0, table=table) as stream:
        for _ in range(4):
            _, info = next(stream)
            rows = zip(
                info.key.reshape(len(info.key), -1)[:, 0].tolist(),
                info.priority.reshape(len(info.key), -1)[:, 0].tolist(),
                info.probability.reshape(len(info.key), -1)[:, 0].tolist(),
                strict=True,
            )
            for key, priority, probability in rows:
                seen[int(key)] = (priority, probability)
    return seen


def assert_priorities(manager: Any, table: str, keys: list[int], expected: list[float]) -> None:
    """Sampling `table` shows exactly `expected` (per key of `keys`): items of priority 0 are
    never drawn, the others with probability priority / sum (all those of 5% or more seen)."""
    seen = sampled(manager, table)
    total = sum(expected)
    want = {
        key: (priority, priority / total)
        for key, priority in zip(keys, expected, strict=True)
        if priority > 0
    }
    likely = {key for key, (_, probability) in want.items() if probability >= 0.05}
    assert likely <= set(seen) <= set(want), (seen, want)
    for key in seen:
        assert seen[key][0] == pytest.approx(want[key][0]), (key, seen, want)
        assert seen[key][1] == pytest.approx(want[key][1]), (key, seen, want)


UNCHANGED = [1.0, 1.0, 1.0]
NAN, INF = float("nan"), float("inf")

# (name, updates from (primary keys, other keys), outcome): the outcome is the primary table's
# priorities afterwards, or (error class, text the message names).
Case = tuple[str, Callable[[list[int], list[int]], dict[Any, Any]], Any]
MUTATE_CASES: list[Case] = [
    ("zero", lambda k, o: {k[0]: 0.0}, [0.0, 1.0, 1.0]),
    ("float", lambda k, o: {k[0]: 2.5}, [2.5, 1.0, 1.0]),
    ("int", lambda k, o: {k[0]: 3}, [3.0, 1.0, 1.0]),
    ("numpy float32", lambda k, o: {k[0]: np.float32(2.0)}, [2.0, 1.0, 1.0]),
    ("numpy uint64 key", lambda k, o: {np.uint64(k[1]): 3.0}, [1.0, 3.0, 1.0]),
    ("numpy int64 key", lambda k, o: {np.int64(k[1] % 2**63): 3.0}, None),
    ("huge", lambda k, o: {k[0]: 1e300}, [1e300, 1.0, 1.0]),
    ("unknown key", lambda k, o: {max(k + o) + 7919: 5.0, k[2]: 3.0}, [1.0, 1.0, 3.0]),
    ("key 0", lambda k, o: {0: 5.0, k[2]: 3.0}, [1.0, 1.0, 3.0]),
    ("other table's keys", lambda k, o: dict.fromkeys(o, 7.0), UNCHANGED),
    ("empty", lambda k, o: {}, UNCHANGED),
    ("nan", lambda k, o: {k[0]: NAN}, (ConfigError, "nan")),
    ("+inf", lambda k, o: {k[0]: INF}, (ConfigError, "inf")),
    ("-inf", lambda k, o: {k[0]: -INF}, (ConfigError, "-inf")),
    ("negative", lambda k, o: {k[0]: -1.0}, (ConfigError, "-1.0")),
    ("bool priority", lambda k, o: {k[0]: True}, (ConfigError, "True")),
    ("string priority", lambda k, o: {k[0]: "2"}, (ConfigError, "'2'")),
    ("None priority", lambda k, o: {k[0]: None}, (ConfigError, "None")),
    ("good then nan", lambda k, o: {k[1]: 9.0, k[0]: NAN}, (ConfigError, "nan")),
    ("good then negative", lambda k, o: {k[1]: 9.0, k[0]: -2.0}, (ConfigError, "-2.0")),
    ("float key", lambda k, o: {float(k[0]): 2.0}, (SpecMismatchError, "keys")),
    ("fractional key", lambda k, o: {k[0] + 0.5: 2.0}, (SpecMismatchError, "bad key")),
    ("bool key", lambda k, o: {True: 2.0}, (SpecMismatchError, "True")),
    ("string key", lambda k, o: {str(k[0]): 2.0}, (SpecMismatchError, "'")),
    ("negative key", lambda k, o: {-1: 2.0}, (SpecMismatchError, "-1")),
    ("key 2**64", lambda k, o: {2**64: 2.0}, (SpecMismatchError, str(2**64))),
    ("good then float key", lambda k, o: {k[1]: 9.0, 1.5: 2.0}, (SpecMismatchError, "1.5")),
]


@pytest.mark.parametrize(
    "name, make_updates, outcome", MUTATE_CASES, ids=[c[0] for c in MUTATE_CASES]
)
def test_py_client_mutate_priorities_accepts_and_refuses_alike(buffer, name, make_updates, outcome):
    manager, keys = buffer
    updates = make_updates(keys[PRIMARY], keys[OTHER])
    if outcome is None:  # numpy int64 keys below 2**63: an item's if its key is one, else none
        key = int(next(iter(updates)))
        outcome = [3.0 if k == key else 1.0 for k in keys[PRIMARY]]
    if isinstance(outcome, tuple):
        error, text = outcome
        with pytest.raises(error) as raised:
            manager.py_client.mutate_priorities(PRIMARY, updates=updates)
        # The project's errors are ValueErrors, as Reverb's own refusals of NaN and negatives.
        assert isinstance(raised.value, ReplayServiceError | ValueError)
        assert text in str(raised.value), raised.value
        outcome = UNCHANGED
    else:
        manager.py_client.mutate_priorities(PRIMARY, updates=updates)
    assert_priorities(manager, PRIMARY, keys[PRIMARY], outcome)
    assert_priorities(manager, OTHER, keys[OTHER], UNCHANGED)


# (name, (keys, priorities) from (primary keys, other keys), outcome) for update_priorities.
UPDATE_CASES: list[Case] = [
    ("arrays", lambda k, o: (np.array(k, np.uint64), np.array([0.0, 2.0, 1.0])), [0.0, 2.0, 1.0]),
    ("lists", lambda k, o: (list(k), [1.0, 1.0, 4.0]), [1.0, 1.0, 4.0]),
    ("other table's keys", lambda k, o: (o, [5.0, 6.0, 7.0]), UNCHANGED),
    ("mixed tables", lambda k, o: ([o[0], k[0]], [5.0, 6.0]), [6.0, 1.0, 1.0]),
    ("nan", lambda k, o: (k, [2.0, NAN, 1.0]), (ConfigError, "nan")),
    ("+inf", lambda k, o: (k, [2.0, INF, 1.0]), (ConfigError, "inf")),
    ("-inf", lambda k, o: (k, [2.0, -INF, 1.0]), (ConfigError, "-inf")),
    ("negative", lambda k, o: (k, [2.0, -3.0, 1.0]), (ConfigError, "-3.0")),
    ("bool priorities", lambda k, o: (k, np.array([True, False, True])), (ConfigError, "bool")),
    ("string priorities", lambda k, o: (k, ["1", "2", "3"]), (ConfigError, "'1'")),
    ("float keys", lambda k, o: (np.array(k, np.float64), [2.0] * 3), (SpecMismatchError, "float")),
    ("float key in a list", lambda k, o: ([k[0], 1.5], [2.0, 2.0]), (SpecMismatchError, "1.5")),
    ("bool key", lambda k, o: ([True], [2.0]), (SpecMismatchError, "True")),
    ("negative key", lambda k, o: ([k[0], -3], [2.0, 2.0]), (SpecMismatchError, "-3")),
    ("key of 2**64", lambda k, o: ([k[0], 2**64], [2.0, 2.0]), (SpecMismatchError, str(2**64))),
    ("more keys", lambda k, o: (k, [2.0, 2.0]), (SpecMismatchError, "3 keys and 2")),
    ("more priorities", lambda k, o: (k[:2], [2.0] * 3), (SpecMismatchError, "2 keys and 3")),
]


@pytest.mark.parametrize("name, make_args, outcome", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_update_priorities_accepts_and_refuses_alike(buffer, name, make_args, outcome):
    manager, keys = buffer
    args = make_args(keys[PRIMARY], keys[OTHER])
    if isinstance(outcome, tuple):
        error, text = outcome
        with pytest.raises(error) as raised:
            manager.update_priorities(*args, table=PRIMARY)
        assert text in str(raised.value), raised.value
        outcome = UNCHANGED
    else:
        manager.update_priorities(*args, table=PRIMARY)
    assert_priorities(manager, PRIMARY, keys[PRIMARY], outcome)
    assert_priorities(manager, OTHER, keys[OTHER], UNCHANGED)


def test_keys_of_one_table_never_change_another(buffer):
    manager, keys = buffer
    assert not set(keys[PRIMARY]) & set(keys[OTHER]), keys
    manager.update_priorities(keys[OTHER], [0.0, 5.0, 9.0], table=PRIMARY)
    assert_priorities(manager, PRIMARY, keys[PRIMARY], UNCHANGED)
    assert_priorities(manager, OTHER, keys[OTHER], UNCHANGED)
    manager.update_priorities(
        keys[PRIMARY] + keys[OTHER], [0.0, 2.0, 3.0, 4.0, 0.0, 1.0], table=OTHER
    )
    assert_priorities(manager, PRIMARY, keys[PRIMARY], UNCHANGED)
    assert_priorities(manager, OTHER, keys[OTHER], [4.0, 0.0, 1.0])


@pytest.mark.parametrize(
    "priority, error",
    [
        (0.0, None),
        (2.5, None),
        (NAN, ConfigError),
        (INF, ConfigError),
        (-INF, ConfigError),
        (-1.0, ConfigError),
        (True, ConfigError),
    ],
    ids=["zero", "float", "nan", "+inf", "-inf", "negative", "bool"],
)
def test_writer_priorities_accepted_and_refused_alike(fresh_buffer, priority, error):
    manager, keys = fresh_buffer
    if error is not None:
        with pytest.raises(error, match=str(priority)):
            manager.transition_writer(priority=priority)
        assert_priorities(manager, PRIMARY, keys[PRIMARY], UNCHANGED)
        return
    writer = manager.transition_writer(priority=priority)
    writer.add(STEP * 7, 0, 7.0, STEP * 8, True, False)
    writer.flush()
    expected = [*UNCHANGED, priority]
    found = sampled(manager, PRIMARY)
    assert len(found) == ITEMS + (priority > 0), found
    for key, (value, probability) in found.items():
        want = priority if key not in keys[PRIMARY] else 1.0
        assert value == pytest.approx(want)
        assert probability == pytest.approx(want / sum(expected))


@pytest.mark.parametrize(
    "priority", [NAN, INF, -1.0, True], ids=["nan", "+inf", "negative", "bool"]
)
def test_reverb_py_client_insert_refuses_bad_priorities(make_manager, tmp_path, priority):
    manager = make_manager(
        backend="reverb", checkpoint_dir=str(tmp_path / "c"), capacity=10, layout="nested"
    )
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match=str(priority)):
        manager.py_client.insert([STEP], {manager.table_name: priority})
    assert manager.num_frames() == 0


def test_local_checkpoints_store_no_keys_and_restore_disjoint_keys(
    fresh_buffer, make_manager, tmp_path
):
    manager, keys = fresh_buffer
    if manager.backend != "local":
        pytest.skip("the local backend's checkpoint format")
    manager.update_priorities(keys[PRIMARY], [0.0, 2.0, 3.0], table=PRIMARY)
    manager.update_priorities(keys[OTHER], [4.0, 0.0, 6.0], table=OTHER)
    directory = manager.checkpoint_dir
    manager.checkpoint()
    manager.close()
    loaded = make_manager(
        backend="local",
        checkpoint_dir=directory,
        capacity=50,
        table_name=PRIMARY,
        sampling=_sampling(),
        extra_tables=[TableConfig(OTHER, 50, 2, sampling=_sampling())],
    )
    loaded.load_replay_buffer()
    restored = {name: sampled(loaded, name) for name in (PRIMARY, OTHER)}
    assert not set(restored[PRIMARY]) & set(restored[OTHER]), restored
    assert sorted(p for p, _ in restored[PRIMARY].values()) == [2.0, 3.0]
    assert sorted(p for p, _ in restored[OTHER].values()) == [4.0, 6.0]
    loaded.update_priorities(list(restored[OTHER]), [9.0, 9.0], table=PRIMARY)
    assert sorted(p for p, _ in sampled(loaded, PRIMARY).values()) == [2.0, 3.0]


def test_nested_reverb_py_client_checks_a_batch_whole(make_manager, tmp_path):
    manager = make_manager(
        backend="reverb",
        checkpoint_dir=str(tmp_path / "nested"),
        capacity=10,
        layout="nested",
        table_name=PRIMARY,
        sampling=_sampling(),
    )
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for i in range(ITEMS):
        writer.add(STEP * i, 0, float(i), STEP * (i + 1), i == ITEMS - 1, False)
    writer.flush()
    keys = sorted(sampled(manager, PRIMARY))
    with pytest.raises(ConfigError, match="nan"):
        manager.py_client.mutate_priorities(PRIMARY, updates={keys[1]: 9.0, keys[0]: NAN})
    assert_priorities(manager, PRIMARY, keys, UNCHANGED)
    manager.py_client.mutate_priorities(PRIMARY, updates={keys[1]: 9.0})
    assert_priorities(manager, PRIMARY, keys, [1.0, 9.0, 1.0])
