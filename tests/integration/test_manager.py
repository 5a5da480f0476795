"""ReplayBufferManager against a real Reverb server and real TF-Agents collection."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import reverb
import tensorflow as tf
from tf_agents.specs import tensor_spec
from tf_agents.train import actor
from tf_agents.train.utils import train_utils
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import FAST_TIMEOUTS, all_items, collect
from replay_service import (
    BufferStateError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    ManagerClosedError,
    NoCheckpointError,
    PortInUseError,
    ReplayBufferManager,
    ServerUnavailableError,
    SpecMismatchError,
    Timeouts,
)
from replay_service.specs.packed import unpack
from replay_service.storage.directory import CHECKPOINTS_DIR, REVERB_DIR

LAST = 2
FIRST = 0


def test_create_gives_an_empty_buffer_that_an_actor_fills(make_manager, env, policy):
    manager = make_manager()
    replay_buffer, observer = manager.create_replay_buffer()
    assert manager.num_frames() == 0
    collect_actor = actor.Actor(
        env, policy, train_utils.create_train_step(), steps_per_run=120, observers=[observer]
    )
    collect_actor.run()
    observer.flush()
    assert manager.num_frames() > 100
    assert int(replay_buffer.num_frames()) == manager.num_frames()


def test_num_frames_counts_windows_not_steps(make_manager, env, policy):
    manager = make_manager(sequence_length=3)
    _, observer = manager.create_replay_buffer()
    steps = []

    class Recorder:
        def __call__(self, t):
            steps.append(int(t.step_type))
            observer(t)

        flush = observer.flush

    collect(env, policy, Recorder(), 150)
    episodes = np.split(np.array(steps), np.flatnonzero(np.array(steps) == LAST) + 1)
    expected = sum(max(0, len(e) - 3 + 1) for e in episodes if len(e))
    assert manager.num_frames() == expected


@pytest.mark.heavy
def test_no_sampled_window_spans_two_episodes(make_manager, env, policy):
    manager = make_manager(sequence_length=4)
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 300)
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    index = [p for p, _ in _paths(manager)].index("step_type")
    for data in items.values():
        step_types = data[index]
        # A LAST step (episode boundary) can only be the final step of a window.
        assert LAST not in step_types[:-1], step_types
        assert FIRST not in step_types[1:], step_types


def _paths(manager):
    from replay_service.specs.nests import flatten_with_paths

    return flatten_with_paths(manager._data_spec)


def test_restore_gives_back_the_same_items(make_manager, env, policy, tmp_path):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 60)
    written = all_items(manager.py_client, manager.table_name, manager.num_frames())
    path = manager.checkpoint()
    assert os.path.isfile(os.path.join(path, "DONE"))
    manager.close()

    restored = make_manager()
    restored.load_replay_buffer()
    read = all_items(restored.py_client, restored.table_name, len(written))
    assert read.keys() == written.keys()
    for key, data in written.items():
        for a, b in zip(data, read[key], strict=True):
            np.testing.assert_array_equal(a, b)


def test_create_refuses_a_directory_with_checkpoints_and_keeps_them(make_manager, env, policy):
    first = make_manager()
    _, observer = first.create_replay_buffer()
    collect(env, policy, observer, 30)
    count = first.num_frames()
    first.checkpoint()
    first.close()

    second = make_manager()
    with pytest.raises(CheckpointExistsError, match="load_replay_buffer.*overwrite=True"):
        second.create_replay_buffer()
    second.close()

    third = make_manager()
    third.load_replay_buffer()
    assert third.num_frames() == count


def test_create_with_overwrite_starts_empty(make_manager, env, policy):
    first = make_manager()
    _, observer = first.create_replay_buffer()
    collect(env, policy, observer, 30)
    first.checkpoint()
    first.close()

    second = make_manager()
    second.create_replay_buffer(overwrite=True)
    assert second.num_frames() == 0
    second.checkpoint()
    second.close()
    third = make_manager()
    third.load_replay_buffer()
    assert third.num_frames() == 0


def test_load_of_missing_or_empty_directory_is_an_error(make_manager, tmp_path):
    with pytest.raises(NoCheckpointError, match="does not exist"):
        make_manager(checkpoint_dir=str(tmp_path / "nope")).load_replay_buffer()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointError, match="is empty"):
        make_manager(checkpoint_dir=str(tmp_path / "empty")).load_replay_buffer()


def test_load_of_a_created_but_never_checkpointed_buffer_is_an_error(make_manager):
    first = make_manager()
    first.create_replay_buffer()
    first.close()
    with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
        make_manager().load_replay_buffer()


def test_foreign_directory_is_refused_and_untouched(make_manager, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for call in ("create_replay_buffer", "load_replay_buffer"):
        with pytest.raises(CheckpointError, match="not a replay_service checkpoint directory"):
            getattr(make_manager(checkpoint_dir=str(foreign)), call)()
    with pytest.raises(CheckpointError, match="notes.txt"):
        make_manager(checkpoint_dir=str(foreign)).create_replay_buffer(overwrite=True)
    assert os.listdir(foreign) == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "mine"


def test_bare_reverb_checkpoint_root_is_recognised(make_manager, tmp_path):
    bare = tmp_path / "bare"
    (bare / "2024-01-01T00:00:00").mkdir(parents=True)
    (bare / "2024-01-01T00:00:00" / "DONE").write_text("")
    with pytest.raises(CheckpointError, match="bare Reverb checkpoint root"):
        make_manager(checkpoint_dir=str(bare)).load_replay_buffer()


def test_unwritable_checkpoint_dir_is_an_error(make_manager, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="a_file"):
        make_manager(checkpoint_dir=str(blocker / "ckpt")).create_replay_buffer()
    with pytest.raises(CheckpointError, match="not a directory"):
        make_manager(checkpoint_dir=str(blocker)).load_replay_buffer()


def _saved(make_manager, env, policy, **kwargs):
    manager = make_manager(**kwargs)
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 20)
    manager.checkpoint()
    manager.close()


def test_load_names_every_mismatched_field(make_manager, env, policy, data_spec):
    _saved(make_manager, env, policy)
    wrong_spec = data_spec._replace(
        observation=tf.TensorSpec([5], tf.float32, "observation"),
        reward=tf.TensorSpec([], tf.float64, "reward"),
    )
    with pytest.raises(SpecMismatchError) as info:
        make_manager(data_spec=wrong_spec).load_replay_buffer()
    message = str(info.value)
    assert "'observation'" in message and "float32[5]" in message
    assert "'reward'" in message and "float64[]" in message

    with pytest.raises(SpecMismatchError, match="sequence_length: requested 3, stored 2"):
        make_manager(sequence_length=3).load_replay_buffer()
    with pytest.raises(SpecMismatchError, match="table_name: requested 'other'"):
        make_manager(table_name="other").load_replay_buffer()
    with pytest.raises(SpecMismatchError, match="capacity: requested 500, stored 1000"):
        make_manager(capacity=500).load_replay_buffer()
    # The refusals left the checkpoint loadable.
    make_manager().load_replay_buffer()


@pytest.mark.parametrize("capacity", [0, -5, 2.5, True, None])
def test_bad_capacity_is_refused(make_manager, capacity):
    with pytest.raises(ConfigError, match=f"capacity must be a positive integer, got {capacity!r}"):
        make_manager(capacity=capacity)


@pytest.mark.parametrize("sequence_length", [0, -1])
def test_bad_sequence_length_is_refused(make_manager, sequence_length):
    with pytest.raises(ConfigError, match="sequence_length"):
        make_manager(sequence_length=sequence_length)


def test_bad_data_spec_is_refused(make_manager):
    with pytest.raises(SpecMismatchError, match="'x' is not a TensorSpec"):
        make_manager(data_spec={"x": 3})
    with pytest.raises(SpecMismatchError, match="no tensors"):
        make_manager(data_spec={})


def test_wrongly_shaped_step_is_rejected_and_data_kept(
    make_manager, env, policy, data_spec, tmp_path
):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 20)
    count = manager.num_frames()

    good = tensor_spec.sample_spec_nest(data_spec, outer_dims=())
    good = tf.nest.map_structure(lambda t: t.numpy(), good)
    bad = good._replace(observation=np.zeros([5], np.float32))
    _, fresh = manager.get_replay_buffer_and_observer()
    with pytest.raises(
        SpecMismatchError, match=r"'observation': expected float32\[4\], got float32\[5\]"
    ):
        fresh(bad)
    batched = tf.nest.map_structure(lambda x: np.stack([x, x]), good)
    _, fresh = manager.get_replay_buffer_and_observer()
    with pytest.raises(SpecMismatchError, match="unbatched"):
        fresh(batched)
    # The writer of `py_client` (the default packed layout's `PackingClient`) refuses the step.
    with pytest.raises(SpecMismatchError, match=r"'observation': expected float32\[4\]"):
        with manager.py_client.trajectory_writer(num_keep_alive_refs=2) as writer:
            for _ in range(2):
                writer.append(tf.nest.flatten(bad))
            writer.create_item(manager.table_name, 1.0, [col[-2:] for col in writer.history])
    assert manager.num_frames() == count
    # A plain Reverb writer on a nested table is stopped by the table signature at insert.
    nested = make_manager(checkpoint_dir=str(tmp_path / "nested"), layout="nested")
    nested.create_replay_buffer()
    with pytest.raises(ValueError, match="inconsistent with the table signature"):
        with nested.py_client.trajectory_writer(num_keep_alive_refs=2) as writer:
            for _ in range(2):
                writer.append(tf.nest.flatten(bad))
            writer.create_item(nested.table_name, 1.0, [col[-2:] for col in writer.history])
    assert nested.num_frames() == 0


def test_an_observer_rejects_a_late_mismatch(make_manager, data_spec):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    good = tf.nest.map_structure(
        lambda t: t.numpy(), tensor_spec.sample_spec_nest(data_spec, outer_dims=())
    )
    good = good._replace(step_type=np.int32(1), next_step_type=np.int32(1))
    for _ in range(3):
        observer(good)
    with pytest.raises(SpecMismatchError, match="'action'"):
        observer(good._replace(action=np.zeros([3], np.int64)))


@pytest.mark.parametrize("layout", ["auto", "nested"])
def test_table_has_a_signature_plain_reverb_can_use(make_manager, env, policy, data_spec, layout):
    """A plain Reverb dataset reads the table; the default (packed) rows unpack into the
    Trajectory with `specs.packed.unpack`, as the packed-layout guide shows."""
    manager = make_manager(layout=layout)
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    info = manager.py_client.server_info()[manager.table_name]
    dataset = reverb.TrajectoryDataset.from_table_signature(
        manager.server_address, manager.table_name, max_in_flight_samples_per_worker=4
    )
    sample = next(iter(dataset.take(1)))
    data = sample.data
    if layout == "auto":
        assert info.signature == tf.TensorSpec([2, 40], tf.uint8, "packed")
        data = unpack(data.numpy(), data_spec)
    else:
        assert info.signature.observation.shape == [2, 4]
    assert data.observation.shape == (2, 4)
    assert data.observation.dtype == tf.float32


@pytest.mark.heavy
def test_get_dataset_samples_batches(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 100)
    trajectories, info = next(iter(manager.get_dataset(batch_size=8, num_steps=2)))
    assert isinstance(trajectories, trajectory_lib.Trajectory)
    assert trajectories.observation.shape == [8, 2, 4]
    assert info.key.shape[0] == 8


@pytest.mark.heavy
def test_sampling_an_empty_buffer_fails_within_the_timeout(make_manager):
    manager = make_manager(timeouts=Timeouts(sample=0.5))
    replay_buffer, _ = manager.create_replay_buffer()
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="no item could be sampled from table"):
        next(iter(manager.get_dataset(batch_size=4, num_steps=2)))
    assert time.monotonic() - start < 30
    # The seed's path, replay_buffer.as_dataset(...).prefetch(3), fails the same way.
    dataset = replay_buffer.as_dataset(sample_batch_size=4, num_steps=2, num_parallel_calls=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the buffer is empty"):
        next(iter(dataset.prefetch(3)))


@pytest.mark.heavy
def test_clear_empties_in_place_and_is_not_undone_by_load(make_manager, env, policy):
    manager = make_manager()
    replay_buffer, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 50)
    manager.checkpoint()
    manager.clear()
    assert manager.num_frames() == 0
    # Everything handed out still works against the same server.
    collect(env, policy, observer, 30)
    assert int(replay_buffer.num_frames()) == manager.num_frames() > 0
    next(iter(manager.get_dataset(batch_size=2, num_steps=2)))
    manager.clear()
    manager.close()
    reloaded = make_manager()
    reloaded.load_replay_buffer()
    assert reloaded.num_frames() == 0


def test_checkpoint_survives_later_checkpoints_and_retention(make_manager, env, policy):
    manager = make_manager(keep_checkpoints=2)
    _, observer = manager.create_replay_buffer()
    paths = []
    for _ in range(3):
        collect(env, policy, observer, 10)
        paths.append(manager.checkpoint())
    assert not os.path.exists(paths[0])
    for path in paths[1:]:
        assert os.path.isfile(os.path.join(path, "DONE"))
    checkpoints_root = os.path.dirname(paths[-1])
    assert sorted(os.listdir(checkpoints_root)) == sorted(os.path.basename(p) for p in paths[1:])


def test_foreign_entries_in_reverb_root_cannot_delete_a_checkpoint(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 20)
    count = manager.num_frames()
    reverb_root = os.path.join(manager.checkpoint_dir, REVERB_DIR)
    # Entries that sort after any timestamp: a stray file and a clock-skewed half checkpoint.
    with open(os.path.join(reverb_root, "zzz_README"), "w") as f:
        f.write("x")
    os.makedirs(os.path.join(reverb_root, "9999-12-31T00:00:00"))
    path = manager.checkpoint()
    assert os.path.isfile(os.path.join(path, "DONE"))
    manager.close()
    reloaded = make_manager()
    reloaded.load_replay_buffer()
    assert reloaded.num_frames() == count


def test_seed_style_py_client_checkpoint_is_loaded(make_manager, env, policy):
    manager = make_manager()
    replay_buffer, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 25)
    count = manager.num_frames()
    replay_buffer.py_client.checkpoint()
    manager.close()
    reloaded = make_manager()
    reloaded.load_replay_buffer()
    assert reloaded.num_frames() == count
    assert len(os.listdir(os.path.join(reloaded.checkpoint_dir, CHECKPOINTS_DIR))) == 1


def test_close_is_idempotent_and_use_after_close_fails(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    manager.close()
    manager.close()
    for call in (
        manager.num_frames,
        manager.checkpoint,
        manager.clear,
        manager.create_replay_buffer,
        manager.load_replay_buffer,
        manager.get_replay_buffer_and_observer,
        lambda: manager.get_dataset(4),
    ):
        with pytest.raises(ManagerClosedError, match="closed"):
            call()
    with pytest.raises(ManagerClosedError):
        collect(env, policy, observer, 5)


def test_context_manager_releases_the_directory(make_manager, data_spec, tmp_path):
    with ReplayBufferManager(data_spec, 100, str(tmp_path / "c"), timeouts=FAST_TIMEOUTS) as m:
        m.create_replay_buffer()
        m.checkpoint()
    with ReplayBufferManager(data_spec, 100, str(tmp_path / "c"), timeouts=FAST_TIMEOUTS) as m:
        m.load_replay_buffer()
        assert m.num_frames() == 0


def test_a_directory_in_use_is_refused(make_manager):
    make_manager().create_replay_buffer()
    with pytest.raises(CheckpointError, match="in use by another buffer"):
        make_manager().load_replay_buffer()


def test_calls_in_the_wrong_order(make_manager):
    manager = make_manager()
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.get_replay_buffer_and_observer()
    with pytest.raises(BufferStateError):
        manager.num_frames()
    manager.create_replay_buffer()
    with pytest.raises(BufferStateError, match="already has a buffer"):
        manager.create_replay_buffer()


def test_port_in_use_is_refused(make_manager, tmp_path):
    first = make_manager()
    first.create_replay_buffer()
    port = int(first.server_address.rsplit(":", 1)[1])
    with pytest.raises(PortInUseError, match=f"port {port} is already in use"):
        make_manager(checkpoint_dir=str(tmp_path / "other"), port=port).create_replay_buffer()


@pytest.mark.heavy
def test_remote_manager_shares_the_embedded_server(make_manager, env, policy):
    owner = make_manager()
    _, owner_observer = owner.create_replay_buffer()
    collect(env, policy, owner_observer, 30)
    remote = make_manager(server_address=owner.server_address, checkpoint_dir=None)
    _, observer = remote.load_replay_buffer()
    assert remote.num_frames() == owner.num_frames()
    before = owner.num_frames()
    collect(env, policy, observer, 30)
    assert owner.num_frames() > before
    batch, _ = next(iter(remote.get_dataset(batch_size=4, num_steps=2)))
    assert batch.observation.shape == [4, 2, 4]


def test_remote_manager_checks_the_table(make_manager, data_spec):
    owner = make_manager()
    owner.create_replay_buffer()
    wrong = data_spec._replace(observation=tf.TensorSpec([7], tf.float32))
    with pytest.raises(SpecMismatchError, match="'observation'"):
        make_manager(
            server_address=owner.server_address, data_spec=wrong, checkpoint_dir=None
        ).load_replay_buffer()
    with pytest.raises(SpecMismatchError, match="no table 'nope'"):
        make_manager(
            server_address=owner.server_address, table_name="nope", checkpoint_dir=None
        ).load_replay_buffer()


@pytest.mark.heavy
def test_server_down_gives_a_clear_error_within_the_timeout(make_manager):
    from replay_service.backends.reverb.connection import pick_free_port

    address = f"localhost:{pick_free_port()}"
    manager = make_manager(server_address=address, timeouts=Timeouts(connect=1.0))
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=address):
        manager.load_replay_buffer()
    assert time.monotonic() - start < 20


def test_pick_free_port_never_hands_out_a_port_twice_in_one_process():
    from replay_service.backends.reverb.connection import pick_free_port

    ports = [pick_free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


@pytest.mark.heavy
def test_a_client_whose_first_call_stalls_is_replaced_within_the_timeout():
    from replay_service.backends.reverb.connection import first_answer, pick_free_port

    server = reverb.Server(
        [reverb.Table.queue("q", 10)], port=pick_free_port()
    )  # a live server for the second client
    addresses = [f"localhost:{pick_free_port()}", f"localhost:{server.port}"]
    made: list[str] = []

    def new_client() -> reverb.Client:
        made.append(addresses[min(len(made), 1)])
        return reverb.Client(made[-1])

    try:
        client = first_answer(new_client, 6.0)
        assert client.server_address == addresses[1]
        assert made == addresses
        dead = addresses[0]
        with pytest.raises(ServerUnavailableError, match=rf"{dead}.*within 3.0 s") as raised:
            first_answer(lambda: reverb.Client(dead), 3.0)
        assert "did not complete" in str(raised.value)
    finally:
        server.stop()


def test_bad_server_address_is_refused(make_manager):
    with pytest.raises(ConfigError, match="host:port"):
        make_manager(server_address="nonsense", checkpoint_dir=None).load_replay_buffer()


def test_embedded_mode_needs_a_checkpoint_dir(data_spec):
    with pytest.raises(ConfigError, match="checkpoint_dir is required"):
        ReplayBufferManager(data_spec, 10)
