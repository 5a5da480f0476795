"""The same behaviour from both engines: every test runs on Reverb and on the local backend.

The parity tests write the same steps into a Reverb buffer and a local one and compare what
each stores (read through `export`), so the local window logic is checked against Reverb's
structured writer; the portability tests move an export from one engine to the other and back.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reverb
from safetensors.numpy import load_file
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy

from conftest import collect
from replay_service import (
    ManagerClosedError,
    ReplayBufferManager,
    SamplingConfig,
    TableConfig,
)

BACKENDS = ("reverb", "local")
STEP = np.array([0, 1, 0, 0], np.float32)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture()
def make(make_manager, backend, tmp_path):
    """Managers of the parametrized backend (CartPole spec, small capacity)."""

    def factory(name: str = "ckpt", **kwargs: Any) -> ReplayBufferManager:
        kwargs.setdefault("capacity", 200)
        return make_manager(backend=backend, checkpoint_dir=str(tmp_path / name), **kwargs)

    return factory


# ---------------------------------------------------------------------------------- helpers


def state(episode: int, index: int) -> np.ndarray:
    """The CartPole-shaped observation `[episode, index, 0, 0]` (unique per step)."""
    return np.array([episode, index, 0, 0], np.float32)


def write_episode(
    writer: Any, episode: int, length: int, *, truncated: bool = False, end: bool = True
) -> None:
    """Writes `length` transitions of one episode through a `TransitionWriter`.

    The last one terminates (or truncates) the episode when `end` is True.
    """
    for i in range(length):
        last = end and i == length - 1
        writer.add(
            state(episode, i),
            i % 2,
            float(i),
            state(episode, i + 1),
            last and not truncated,
            last and truncated,
        )


def write_multi(writer: Any, num_envs: int, calls: int, first_episode: int = 100) -> None:
    """`calls` add_multi calls for `num_envs` auto-resetting envs; the last call ends every
    env's episode (env 0 truncated, the others terminated)."""
    for k in range(calls):
        last = k == calls - 1
        states = np.stack([state(first_episode + e, k) for e in range(num_envs)])
        finals = np.stack([state(first_episode + e, k + 1) for e in range(num_envs)])
        resets = np.stack([state(first_episode + num_envs + e, 0) for e in range(num_envs)])
        dones = np.array([last and e > 0 for e in range(num_envs)])
        truncated = np.array([last and e == 0 for e in range(num_envs)])
        writer.add_multi(
            states,
            np.arange(num_envs) % 2,
            np.full(num_envs, float(k), np.float32),
            resets if last else finals,
            dones,
            truncated,
            final_states=finals,
        )


def cartpole() -> tuple[Any, Any]:
    """A freshly seeded CartPole env and random policy: equal trajectories every time."""
    env = suite_gym.load("CartPole-v0")
    env.seed(0)
    return env, random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)


def exported(manager: ReplayBufferManager, directory: Path) -> dict[str, np.ndarray]:
    """Every item of the manager's table, oldest first, as written by `export`."""
    state_path, _ = manager.export(directory)
    return load_file(state_path)


def data_names(tensors: dict[str, np.ndarray]) -> list[str]:
    return sorted(name for name in tensors if name.startswith("data/"))


def item_rows(tensors: dict[str, np.ndarray], with_priority: bool = True) -> list[tuple]:
    """One tuple per item (oldest first): the bytes of each field, and its priority."""
    names = data_names(tensors)
    rows = []
    for i in range(len(tensors["priorities"])):
        row = tuple(tensors[name][i].tobytes() for name in names)
        if with_priority:
            row += (float(tensors["priorities"][i]),)
        rows.append(row)
    return rows


def observations(tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The `[items, sequence_length, 4]` observations of an export (padded or not)."""
    names = [n for n in data_names(tensors) if n.endswith("observation")]
    assert len(names) == 1, names
    return tensors[names[0]]


# ------------------------------------------------------------------------- lifecycle


def test_written_items_survive_checkpoint_close_and_load(make, backend, tmp_path):
    manager = make()
    _, observer = manager.create_replay_buffer()
    env, policy = cartpole()
    collect(env, policy, observer, 30)
    observed = manager.num_frames()
    assert observed > 0
    # Confirmed before the next writer writes: items of different writers reach the table in
    # the order they are sent (a packed writer sends within 50 ms, or at its flush).
    single = manager.transition_writer(priority=2.0)
    write_episode(single, 0, 5)
    single.flush()
    multi = manager.transition_writer()
    write_multi(multi, 3, 4)
    multi.flush()
    # 5 transitions of one episode, then 3 envs x 4 transitions: one item per transition.
    assert manager.num_frames() == observed + 5 + 3 * 4
    before = exported(manager, tmp_path / "before")
    path = manager.checkpoint()
    assert Path(path).parent == tmp_path / "ckpt" / "checkpoints"
    manager.close()

    loaded = make()
    loaded.load_replay_buffer()
    assert loaded.num_frames() == observed + 17
    after = exported(loaded, tmp_path / "after")
    assert item_rows(after) == item_rows(before)
    np.testing.assert_array_equal(after["priorities"][observed : observed + 5], 2.0)


def test_clear_empties_the_buffer_and_a_later_load_stays_empty(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 6)
    manager.checkpoint()
    assert manager.num_frames() == 6
    manager.clear()
    assert manager.num_frames() == 0
    # The buffer stays usable after clear().
    write_episode(manager.transition_writer(), 1, 2)
    assert manager.num_frames() == 2
    manager.clear()
    manager.close()

    loaded = make()
    loaded.load_replay_buffer()
    assert loaded.num_frames() == 0


@pytest.mark.heavy
@pytest.mark.parametrize("transitions", [False, True], ids=["items", "transitions"])
def test_torch_batches_sampled_before_a_clear_are_not_handed_out_after_it(make, transitions):
    # Small batches of a uniform table are fetched several at once (and the Reverb pipeline
    # samples ahead): none of what was fetched before clear() may come out after it.
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 6)
    with manager.torch_batches(4, transitions=transitions, prefetch=0) as stream:
        next(stream)  # the stream now holds items of episode 0 sampled ahead
        manager.clear()
        write_episode(manager.transition_writer(), 1, 6)
        for _ in range(100):
            batch = next(stream)
            observation = batch.states if transitions else batch.observation[:, 0]
            assert set(observation[:, 0].tolist()) == {1.0}, "an item removed by clear()"


def test_context_manager_closes_and_close_is_idempotent(make):
    with make() as manager:
        manager.create_replay_buffer()
        write_episode(manager.transition_writer(), 0, 3)
        assert manager.num_frames() == 3
    with pytest.raises(ManagerClosedError):
        manager.num_frames()
    manager.close()
    manager.close()
    # The directory was released: another manager takes it over.
    again = make()
    again.create_replay_buffer(overwrite=True)
    assert again.num_frames() == 0


# -------------------------------------------------------------------------- sampling


@pytest.mark.heavy
def test_get_dataset_batches_are_batch_by_sequence_with_sample_info(make):
    manager = make(sequence_length=3)
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 8)  # 9 steps: 7 windows of 3
    assert manager.num_frames() == 7
    trajectory, info = next(iter(manager.get_dataset(5)))
    assert trajectory.observation.shape == (5, 3, 4)
    assert trajectory.action.shape == (5, 3)
    assert trajectory.step_type.shape == (5, 3)
    assert type(info)._fields == reverb.replay_sample.SampleInfo._fields
    assert info.key.shape == (5, 3) and info.key.dtype.name == "uint64"
    np.testing.assert_array_equal(info.table_size.numpy(), 7)
    np.testing.assert_allclose(info.probability.numpy(), 1 / 7)
    np.testing.assert_array_equal(info.priority.numpy(), 1.0)
    # The info is broadcast along the sequence; the steps of an item are consecutive.
    assert (info.key.numpy() == info.key.numpy()[:, :1]).all()
    observation = trajectory.observation.numpy()
    np.testing.assert_array_equal(np.diff(observation[:, :, 1], axis=1), 1)


def test_torch_batches_of_transitions_with_info(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 3, 6)
    with manager.torch_batches(16, transitions=True, with_info=True) as stream:
        batch, info = next(stream)
    assert tuple(batch.states.shape) == (16, 4)
    assert tuple(batch.actions.shape) == (16,)
    assert tuple(batch.rewards.shape) == (16,)
    np.testing.assert_array_equal(
        (batch.next_states - batch.states).numpy(), np.tile(STEP, (16, 1))
    )
    index = batch.states[:, 1].numpy()
    np.testing.assert_array_equal(batch.rewards.numpy(), index)
    np.testing.assert_array_equal(batch.actions.numpy(), index % 2)
    np.testing.assert_array_equal(batch.dones.numpy(), index == 5)
    assert not batch.truncated.any()
    assert batch.hiddens is None
    assert str(info.key.dtype) == "torch.uint64" and tuple(info.key.shape) == (16,)
    np.testing.assert_array_equal(info.table_size.numpy(), 6)
    assert (info.times_sampled.numpy() >= 1).all()


def _keys_by_index(manager: ReplayBufferManager, count: int) -> dict[int, int]:
    """Item key per step index of the first state, sampled until all `count` items were seen."""
    keys: dict[int, int] = {}
    with manager.torch_batches(64, transitions=True, with_info=True, prefetch=0) as stream:
        for _ in range(50):
            batch, info = next(stream)
            for index, key in zip(batch.states[:, 1].tolist(), info.key.tolist(), strict=True):
                keys[int(index)] = int(key)
            if len(keys) == count:
                break
    assert len(keys) == count
    return keys


@pytest.mark.heavy
def test_update_priorities_changes_how_often_items_are_sampled(make):
    sampling = SamplingConfig(sampler="prioritized", priority_exponent=1.0)
    manager = make(sampling=sampling)
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 4)
    keys = _keys_by_index(manager, 4)
    manager.update_priorities(
        np.array([keys[0], keys[1], keys[2], keys[3]], np.uint64),
        np.array([0.0, 3.0, 1.0, 1.0]),
    )
    counts: Counter[int] = Counter()
    probability: dict[int, float] = {}
    with manager.torch_batches(100, transitions=True, with_info=True, prefetch=0) as stream:
        for _ in range(20):
            batch, info = next(stream)
            indices = batch.states[:, 1].to(int).tolist()
            counts.update(indices)
            probability.update(zip(indices, info.probability.tolist(), strict=True))
    total = sum(counts.values())
    assert counts[0] == 0, "an item with priority 0 was sampled"
    assert abs(counts[1] / total - 0.6) < 0.08, counts
    assert abs(counts[2] / total - 0.2) < 0.06, counts
    assert probability[1] == pytest.approx(0.6)
    assert probability[3] == pytest.approx(0.2)


@pytest.mark.heavy
def test_fifo_with_max_times_sampled_1_gives_oldest_first_then_nothing(make):
    sampling = SamplingConfig(sampler="fifo", max_times_sampled=1)
    manager = make(sampling=sampling)
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 6)
    seen = []
    with manager.torch_batches(2, transitions=True, prefetch=0) as stream:
        for _ in range(3):
            seen += next(stream).states[:, 1].to(int).tolist()
    assert seen == [0, 1, 2, 3, 4, 5]
    assert manager.num_frames() == 0


@pytest.mark.heavy
def test_fifo_with_max_times_sampled_1_never_repeats_an_item_within_a_batch(make):
    sampling = SamplingConfig(sampler="fifo", max_times_sampled=1)
    manager = make(sampling=sampling)
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 4)
    trajectory, info = next(iter(manager.get_dataset(4, prefetch=1)))
    np.testing.assert_array_equal(trajectory.observation.numpy()[:, 0, 1], [0, 1, 2, 3])
    assert len(set(info.key.numpy()[:, 0].tolist())) == 4
    assert manager.num_frames() == 0


def test_padded_strided_windows_of_three_steps(make, tmp_path):
    manager = make(sequence_length=3, stride_length=2, pad_end_of_episode=True)
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 5)  # steps 0..5 (5 is the boundary step)
    tensors = exported(manager, tmp_path / "export")
    obs = observations(tensors)
    mask = tensors["data/mask"]
    # Windows start at multiples of the stride; the last one is padded.
    np.testing.assert_array_equal(obs[:, 0, 1], [0, 2, 4])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(obs[2, :2, 1], [4, 5])
    batch = next(iter(manager.torch_batches(4)))
    assert tuple(batch.mask.shape) == (4, 3)
    assert tuple(batch.step.observation.shape) == (4, 3, 4)


@pytest.mark.heavy
def test_extra_tables_are_fed_by_one_writer(make):
    triples = TableConfig(name="triples", capacity=50, sequence_length=3)
    manager = make(extra_tables=(triples,))
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 5)  # 6 steps
    assert manager.num_frames() == 5
    assert manager.num_frames(table="triples") == 4
    with manager.torch_batches(8, table="triples", prefetch=0) as stream:
        batch = next(stream)
    assert tuple(batch.observation.shape) == (8, 3, 4)
    np.testing.assert_array_equal(np.diff(batch.observation[:, :, 1].numpy(), axis=1), 1)
    trajectory, _ = next(iter(manager.get_dataset(8, table="triples")))
    assert trajectory.observation.shape == (8, 3, 4)


def test_sampling_after_close_fails(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager.transition_writer(), 0, 3)
    stream = manager.torch_batches(2, prefetch=0)
    next(stream)
    manager.close()
    # Reverb's pipeline may still hand out a few batches it had read ahead; then it fails.
    with pytest.raises(ManagerClosedError):
        for _ in range(20):
            next(stream)
    with pytest.raises(ManagerClosedError):
        manager.torch_batches(2)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("sequence_length", [2, 3])
@pytest.mark.parametrize("stride", [1, 2])
def test_local_windows_equal_reverbs(make_manager, tmp_path, stride, sequence_length, padded):
    stored = {}
    for backend in BACKENDS:
        manager = make_manager(
            backend=backend,
            capacity=500,
            checkpoint_dir=str(tmp_path / backend),
            sequence_length=sequence_length,
            stride_length=stride,
            pad_end_of_episode=padded,
        )
        _, observer = manager.create_replay_buffer()
        env, policy = cartpole()
        collect(env, policy, observer, 40)
        writer = manager.transition_writer(priority=1.5)
        for episode, length in enumerate([1, 2, 3, 4, 5, 7]):
            write_episode(writer, episode, length, truncated=episode % 2 == 1)
        write_episode(writer, 50, 4, end=False)
        writer.reset()
        multi = manager.transition_writer(priority=0.5)
        write_multi(multi, 2, 5)
        manager.checkpoint()  # flushes every writer
        stored[backend] = exported(manager, tmp_path / f"{backend}_export")
        manager.close()
    reverb_items, local_items = stored["reverb"], stored["local"]
    assert data_names(reverb_items) == data_names(local_items)
    assert len(reverb_items["priorities"]) > 30
    assert Counter(item_rows(local_items)) == Counter(item_rows(reverb_items))


# ------------------------------------------------------------------------- portability


@pytest.mark.heavy
@pytest.mark.parametrize("source,target", [("local", "reverb"), ("reverb", "local")])
def test_export_moves_between_backends_item_for_item(make_manager, tmp_path, source, target):
    sampling = SamplingConfig(sampler="prioritized")
    first = make_manager(
        backend=source, capacity=100, checkpoint_dir=str(tmp_path / "a"), sampling=sampling
    )
    _, observer = first.create_replay_buffer()
    env, policy = cartpole()
    collect(env, policy, observer, 20)
    write_episode(first.transition_writer(priority=2.5), 0, 6)
    write_episode(first.transition_writer(priority=0.25), 1, 3, truncated=True)
    with first.torch_batches(5, prefetch=0) as stream:
        next(stream)
    first_state, _ = first.export(tmp_path / "first")
    first_tensors = load_file(first_state)

    second = make_manager(
        backend=target, capacity=100, checkpoint_dir=str(tmp_path / "b"), sampling=sampling
    )
    second.import_buffer(tmp_path / "first")
    assert second.num_frames() == first.num_frames()
    second_tensors = exported(second, tmp_path / "second")
    assert set(second_tensors) == set(first_tensors)
    for name in [*data_names(first_tensors), "priorities"]:
        np.testing.assert_array_equal(second_tensors[name], first_tensors[name], err_msg=name)
    assert sorted(set(first_tensors["priorities"].tolist())) == [0.25, 1.0, 2.5]

    # And back into the first engine.
    third = make_manager(
        backend=source, capacity=100, checkpoint_dir=str(tmp_path / "c"), sampling=sampling
    )
    third.import_buffer(tmp_path / "second")
    third_tensors = exported(third, tmp_path / "third")
    for name in [*data_names(first_tensors), "priorities"]:
        np.testing.assert_array_equal(third_tensors[name], first_tensors[name], err_msg=name)


# ------------------------------------------------------------------- what backend="auto" picks


def test_auto_restores_on_the_backend_that_wrote_the_newest_checkpoint(make_manager, tmp_path):
    for written_by in BACKENDS:
        directory = str(tmp_path / written_by)
        with make_manager(backend=written_by, checkpoint_dir=directory) as manager:
            manager.create_replay_buffer()
            write_episode(manager.transition_writer(), 0, 3)
            manager.checkpoint()
        with make_manager(checkpoint_dir=directory) as again:  # backend="auto"
            assert again.backend == written_by
            again.load_replay_buffer()
            assert again.num_frames() == 3


def test_from_spaces_auto_gives_a_new_buffer_the_local_backend_unless_reverb_is_asked(tmp_path):
    gymnasium = pytest.importorskip("gymnasium")
    spaces = (
        gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32),
        gymnasium.spaces.Discrete(2),
    )
    fresh = ReplayBufferManager.from_spaces(
        *spaces, capacity=10, checkpoint_dir=str(tmp_path / "a")
    )
    assert fresh.backend == "local"
    for option in ({"port": None}, {"layout": "nested"}):  # the defaults ask for nothing
        same = ReplayBufferManager.from_spaces(
            *spaces, capacity=10, checkpoint_dir=str(tmp_path / "b"), **option
        )
        assert same.backend == "local", option
    packed = ReplayBufferManager.from_spaces(
        *spaces, capacity=10, checkpoint_dir=str(tmp_path / "c"), layout="packed"
    )
    assert packed.backend == "reverb"
    directory = str(tmp_path / "reverb")
    with ReplayBufferManager.from_spaces(
        *spaces, capacity=10, checkpoint_dir=directory, backend="reverb"
    ) as manager:
        manager.create_replay_buffer()
        manager.transition_writer().add(STEP, 1, 1.0, STEP, True, False)
        manager.checkpoint()
    with ReplayBufferManager.from_spaces(*spaces, capacity=10, checkpoint_dir=directory) as again:
        assert again.backend == "reverb"
        again.load_replay_buffer()
        assert again.num_frames() == 1


@pytest.mark.heavy
@pytest.mark.parametrize("writer", ["tf_spec", "from_spaces"])
def test_local_checkpoints_and_exports_move_between_tf_and_array_specs(tmp_path, writer):
    """`from_spaces` on the local backend gives an `array_specs.Trajectory`, where it gave TF
    specs before: a buffer written with either spec loads and imports into a manager of the
    other."""
    from gymnasium import spaces

    from replay_service.specs import arrays as array_specs
    from replay_service.specs.nests import data_spec_for_spaces

    observation, action = spaces.Box(-10.0, 10.0, (4,), np.float32), spaces.Discrete(2)
    extras = {"hidden": ((3,), np.float32)}
    tf_spec = data_spec_for_spaces(observation, action, "tf", extras=extras)

    def make(name: str, kind: str) -> ReplayBufferManager:
        options: dict[str, Any] = {
            "capacity": 50,
            "checkpoint_dir": str(tmp_path / name),
            "backend": "local",
        }
        if kind == "tf_spec":
            return ReplayBufferManager(tf_spec, **options)
        return ReplayBufferManager.from_spaces(observation, action, extras=extras, **options)

    reader = "from_spaces" if writer == "tf_spec" else "tf_spec"
    with make("ckpt", writer) as first:
        if writer == "from_spaces":
            assert isinstance(first.data_spec, array_specs.Trajectory), first.data_spec
        first.create_replay_buffer()
        transitions = first.transition_writer()
        for i in range(4):
            transitions.add(
                state(0, i), [i % 2], float(i), state(0, i + 1), i == 3, hidden=np.full(3, i)
            )
        transitions.flush()
        first.checkpoint()
        before = exported(first, tmp_path / "export")
    with make("ckpt", reader) as restored:
        restored.load_replay_buffer()
        after = exported(restored, tmp_path / "restored")
    with make("imported", reader) as imported:
        imported.import_buffer(tmp_path / "export")
        again = exported(imported, tmp_path / "again")
    assert len(before["priorities"]) == 4
    for tensors in (after, again):
        assert item_rows(tensors) == item_rows(before)


@pytest.mark.heavy
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_local_from_spaces_get_dataset_gives_tf_agents_trajectories(tmp_path, padded):
    """`from_spaces` keeps an `array_specs.Trajectory` on the local backend, and `get_dataset`
    (TF-Agents' door) still hands out TF-Agents `Trajectory` batches, padded or not."""
    from gymnasium import spaces
    from tf_agents.trajectories import trajectory

    from replay_service.specs.windows import Masked

    with ReplayBufferManager.from_spaces(
        spaces.Box(-10.0, 10.0, (4,), np.float32),
        spaces.Discrete(2),
        capacity=50,
        checkpoint_dir=str(tmp_path / "ckpt"),
        backend="local",
        sequence_length=3,
        pad_end_of_episode=padded,
    ) as manager:
        manager.create_replay_buffer()
        write_episode(manager.transition_writer(), 0, 4)
        batch, _ = next(iter(manager.get_dataset(2)))
    step = batch.step if padded else batch
    if padded:
        assert isinstance(batch, Masked), type(batch)
    assert isinstance(step, trajectory.Trajectory), type(step)
    assert step.observation.shape == (2, 3, 4) and step.action.shape == (2, 3, 1)
