"""The packed layout returns exactly the items of the nested one, through every reader.

Both layouts get the same recorded CartPole steps; the nested table's items (read with a plain
client) are the reference, and every path of the packed table must yield items from that set
and, sampled long enough, all of them.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import reverb
import tensorflow as tf
import tree
from tf_agents.drivers import py_driver
from tf_agents.replay_buffers import reverb_utils

from replay_service import ReplayBufferManager, TableConfig
from replay_service.backends.reverb import torch_source
from replay_service.backends.reverb.connection import pick_free_port
from replay_service.backends.reverb.packed_writers import PackedWindowWriter
from replay_service.collect.transitions import TransitionWriter
from replay_service.config.files import load_config
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.distributed.sharding import ShardedReplayBuffer
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.sample.batches import draws_per_call
from replay_service.specs import packed
from replay_service.storage.importing import read_export
from replay_service.storage.store import CheckpointStore
from tests.conftest import CARTPOLE_CONFIG, FAST_TIMEOUTS, ServerProcess, all_items

Item = tuple[bytes, ...]


def record(env: Any, policy: Any, steps: int) -> list[Any]:
    """`steps` environment steps of CartPole as unbatched trajectories (episodes end inside)."""
    out: list[Any] = []
    py_driver.PyDriver(env, policy, [out.append], max_steps=steps).run(env.reset())
    return out


def fill(manager: ReplayBufferManager, trajectories: Iterable[Any]) -> Any:
    replay_buffer, observer = manager.create_replay_buffer()
    for trajectory in trajectories:
        observer(trajectory)
    observer.flush()
    return replay_buffer


def batch_items(nest: Any) -> list[Item]:
    """Per batch row: the bytes of every leaf (numpy, tf or torch leaves)."""
    leaves = [np.asarray(x.numpy() if hasattr(x, "numpy") else x) for x in tree.flatten(nest)]
    return [tuple(leaf[b].tobytes() for leaf in leaves) for b in range(leaves[0].shape[0])]


def client_items(manager: ReplayBufferManager, table: str, count: int) -> set[Item]:
    """Every item of a table through a plain `reverb.Client`, decoded with `packed.unpack`
    when the table is packed."""
    return {tuple(x.tobytes() for x in data) for data in client_arrays(manager, table, count)}


def client_arrays(manager: ReplayBufferManager, table: str, count: int) -> list[list[Any]]:
    """`client_items`, each item as its list of leaves (a packed table's rows are unpacked by
    `all_items`, through the manager's `PackingClient`)."""
    if manager.table_config.layout == "packed":
        signature = manager.py_client.server_info()[table].signature
        assert signature.dtype == tf.uint8 and signature.shape.rank == 2
    items = all_items(manager.py_client, table, count)
    return [[np.asarray(x) for x in data] for data in items.values()]


def drain(batches: Iterable[Any], expected: set[Item], extract: Callable[[Any], Any]) -> None:
    """Reads batches until every expected item was seen; every item must be expected.

    The bound is loose on purpose: split into sub-sequences, an episode's first step is in one
    item of ~126, so 2000 batches of 8 rows (~5300 item draws) miss it with probability ~e^-42,
    while 200 batches missed it in about one run of a hundred.
    """
    seen: set[Item] = set()
    for count, batch in enumerate(batches):
        got = batch_items(extract(batch))
        assert set(got) <= expected, "an item that the nested table does not hold"
        seen.update(got)
        if seen == expected:
            return
        assert count < 2000, f"saw {len(seen)} of {len(expected)} items"


@pytest.fixture()
def steps(env: Any, policy: Any) -> list[Any]:
    return record(env, policy, 120)


@pytest.fixture()
def pair(make_manager: Any, tmp_path: Any, steps: list[Any]) -> Any:
    """A nested and a packed buffer of 3-step windows (and a 2-step extra table) holding the
    same steps, and the nested one's items per table."""

    def build(layout: str) -> ReplayBufferManager:
        manager = make_manager(
            sequence_length=3,
            checkpoint_dir=str(tmp_path / layout),
            extra_tables=[TableConfig(name="short", capacity=1000, sequence_length=2)],
            layout=layout,
        )
        fill(manager, steps)
        return manager

    nested, packed_manager = build("nested"), build("packed")
    expected = {
        name: client_items(nested, name, nested.num_frames(table=name))
        for name in (nested.table_name, "short")
    }
    return nested, packed_manager, expected


@pytest.mark.heavy
def test_packed_table_stores_one_uint8_column_and_the_same_items(pair: Any) -> None:
    nested, manager, expected = pair
    info = manager.py_client.server_info()[manager.table_name]
    layout = packed.layout_of(manager.stored_spec)
    assert info.signature == tf.TensorSpec([3, layout.step_bytes], tf.uint8, "packed")
    # CartPole: int32 step type, float64[4] observation, int64 action, int32, float32 x2.
    assert layout.step_bytes == sum(
        np.dtype(s.dtype.as_numpy_dtype).itemsize * int(np.prod(s.shape))
        for s in tree.flatten(manager.data_spec)
    )
    for name, items in expected.items():
        assert manager.num_frames(table=name) == nested.num_frames(table=name) == len(items)
        assert client_items(manager, name, len(items)) == items


@pytest.mark.heavy
def test_get_dataset_as_dataset_and_mixed_dataset_match(pair: Any) -> None:
    nested, manager, expected = pair
    primary = expected[manager.table_name]
    drain(manager.get_dataset(16), primary, lambda b: b[0])
    drain(manager.get_dataset(16, table="short"), expected["short"], lambda b: b[0])
    replay_buffer, _ = manager.get_replay_buffer_and_observer()
    drain(replay_buffer.as_dataset(sample_batch_size=8, num_steps=3), primary, lambda b: b[0])
    mix = manager.mixed_dataset(16, {manager.table_name: 1.0})
    drain(mix, primary, lambda b: b[0])
    # Splitting items into shorter sequences (TF-Agents' pipeline): the same sub-sequences.
    split_nested = {
        tuple(x[t : t + 1].tobytes() for x in item)
        for item in client_arrays(nested, nested.table_name, len(primary))
        for t in range(3)
    }
    drain(manager.get_dataset(8, num_steps=1), split_nested, lambda b: b[0])
    # Same element structure, dtypes and shapes as the nested table's datasets.
    a = next(iter(nested.get_dataset(4)))
    b = next(iter(manager.get_dataset(4)))
    tf.nest.assert_same_structure(a, b)
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape


def fields(batch: Any) -> list[Any]:
    """The tensors of a `TransitionBatch`."""
    return [batch.states, batch.actions, batch.rewards, batch.next_states, batch.dones]


@pytest.mark.heavy
@pytest.mark.parametrize("numpy_unpack", [True, False], ids=["numpy-unpack", "tf-unpack"])
def test_torch_paths_match(
    make_manager: Any, tmp_path: Any, steps: list[Any], numpy_unpack: bool, monkeypatch: Any
) -> None:
    """Small packed steps are unpacked in numpy by the torch path, large ones by TensorFlow
    (`NUMPY_UNPACK_STEP_BYTES`): both give the nested table's items."""
    if not numpy_unpack:
        monkeypatch.setattr(torch_source, "NUMPY_UNPACK_STEP_BYTES", 0)
    expected = {}
    for layout in ("nested", "packed"):
        manager = make_manager(checkpoint_dir=str(tmp_path / layout), layout=layout)
        fill(manager, steps)
        expected[layout] = client_items(manager, manager.table_name, manager.num_frames())
        if layout == "nested":
            transitions = set()
            stream = manager.torch_batches(16, transitions=True)
            for _ in range(150):
                transitions.update(batch_items(fields(next(stream))))
            stream.close()
            with manager.torch_batches(16) as stream:
                nested_batch = next(stream)
    assert expected["nested"] == expected["packed"]
    # The packed rows are unpacked outside TensorFlow: the same nest, dtypes and shapes, and
    # every leaf a contiguous tensor of its own field (a slice of the batches drawn at once),
    # as the nested table's.
    handle = manager.table_handle()
    item_bytes = packed.step_layout(handle.signature).step_bytes * handle.sequence_length
    draws = draws_per_call(16, item_bytes)
    assert draws > 1
    with manager.torch_batches(16) as stream:
        packed_batch = next(stream)
    tree.assert_same_structure(nested_batch, packed_batch)
    for x, y in zip(tree.flatten(nested_batch), tree.flatten(packed_batch), strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert y.is_contiguous() and y.untyped_storage().nbytes() == y.nbytes * draws
    stream = manager.torch_batches(16)
    drain(stream, expected["nested"], lambda b: b)
    stream.close()
    drain(manager.torch_batches(16, transitions=True), transitions, fields)
    dataset = manager.torch_dataset(16)
    drain(iter(dataset), expected["nested"], lambda b: b)


@pytest.mark.heavy
def test_transition_writer_padding_strides_and_extra_tables(
    make_manager: Any, tmp_path: Any
) -> None:
    """TransitionWriter.add / add_multi into padded tables with a stride: the same windows."""
    rng = np.random.default_rng(0)
    calls = []
    for c in range(60):
        states = rng.normal(size=(3, 4)).astype(np.float32)
        dones = rng.random(3) < 0.15
        calls.append((states, np.array([c % 2, 1, 0]), np.full(3, c, np.float32), dones))
    got = {}
    for layout in ("nested", "packed"):
        manager = make_manager(
            checkpoint_dir=str(tmp_path / layout),
            sequence_length=4,
            stride_length=3,
            pad_end_of_episode=True,
            extra_tables=[TableConfig(name="padded2", sequence_length=4, pad_end_of_episode=True)],
            layout=layout,
        )
        manager.create_replay_buffer()
        single = manager.transition_writer(check_continuity=False)
        multi = manager.transition_writer(check_continuity=False)
        for states, actions, rewards, dones in calls:
            single.add(states[0], actions[0], rewards[0], states[1], bool(dones[0]))
            multi.add_multi(states, actions, rewards, states[::-1], dones, final_states=states)
        single.close()
        multi.close()
        got[layout] = {
            name: client_items(manager, name, manager.num_frames(table=name))
            for name in (manager.table_name, "padded2")
        }
        if layout == "packed":
            masked = next(iter(manager.get_dataset(8)))[0]
            assert masked.mask.dtype == tf.bool and masked.mask.shape == (8, 4)
    assert got["nested"] == got["packed"]
    assert any(
        not np.frombuffer(item[-1], bool).all() for item in got["packed"][manager.table_name]
    ), "no padded item was written"


@pytest.mark.heavy
def test_observer_strides_like_the_structured_writer(
    make_manager: Any, tmp_path: Any, steps: list[Any]
) -> None:
    """Stride longer than the window, carried across episodes as Reverb's StructuredWriter
    does, into tables of several lengths."""
    got = {}
    for layout in ("nested", "packed"):
        manager = make_manager(
            checkpoint_dir=str(tmp_path / layout),
            sequence_length=2,
            stride_length=5,
            extra_tables=[TableConfig(name="long", sequence_length=7)],
            layout=layout,
        )
        fill(manager, steps)
        got[layout] = {
            name: client_items(manager, name, manager.num_frames(table=name))
            for name in (manager.table_name, "long")
        }
    assert got["nested"] == got["packed"]
    assert all(len(items) > 3 for items in got["packed"].values())


@pytest.mark.heavy
def test_export_import_and_checkpoints_across_layouts(
    pair: Any, make_manager: Any, tmp_path: Any, steps: list[Any]
) -> None:
    nested, manager, expected = pair
    primary = expected[manager.table_name]
    # Export: one table only, so a fresh pair without the extra table.
    single = {}
    for layout in ("nested", "packed"):
        m = make_manager(
            checkpoint_dir=str(tmp_path / f"single_{layout}"), sequence_length=3, layout=layout
        )
        fill(m, steps)
        m.export(tmp_path / f"export_{layout}")
        single[layout] = m
    a = read_export(nested.table_config, nested.stored_spec, tmp_path / "export_nested")
    b = read_export(nested.table_config, nested.stored_spec, tmp_path / "export_packed")
    assert len(a.data) == len(b.data) and a.num_items == b.num_items > 0
    for x, y in zip(a.data, b.data, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.priorities, b.priorities)
    # An export of either layout imports into the other, item for item.
    imported = make_manager(
        checkpoint_dir=str(tmp_path / "imported"), sequence_length=3, layout="packed"
    )
    imported.import_buffer(tmp_path / "export_nested")
    reference = client_items(single["nested"], "uniform_table", a.num_items)
    assert client_items(imported, "uniform_table", a.num_items) == reference
    back = make_manager(checkpoint_dir=str(tmp_path / "back"), sequence_length=3, layout="nested")
    back.import_buffer(tmp_path / "export_packed")
    assert client_items(back, "uniform_table", a.num_items) == reference

    # Checkpoints record the layout; a restore with the same layout has every item.
    path = manager.checkpoint()
    metadata = CheckpointStore(manager.checkpoint_dir).read_metadata()
    assert metadata.layout == "packed"
    with open(CheckpointStore(manager.checkpoint_dir).store_file) as f:
        assert json.load(f)["layout"] == "packed"
    assert path
    manager.close()
    restored = make_manager(
        checkpoint_dir=manager.checkpoint_dir,
        sequence_length=3,
        extra_tables=[TableConfig(name="short", capacity=1000, sequence_length=2)],
        layout="packed",
    )
    restored.load_replay_buffer()
    assert client_items(restored, restored.table_name, len(primary)) == primary
    drain(restored.get_dataset(16), primary, lambda b: b[0])
    restored.close()
    # The default layout ("auto") is the newest checkpoint's; another one is refused.
    same = make_manager(
        checkpoint_dir=manager.checkpoint_dir,
        sequence_length=3,
        extra_tables=[TableConfig(name="short", capacity=1000, sequence_length=2)],
    )
    assert same.table_config.layout == "packed"
    same.load_replay_buffer()
    assert client_items(same, same.table_name, len(primary)) == primary
    same.close()
    other = make_manager(
        checkpoint_dir=manager.checkpoint_dir,
        sequence_length=3,
        extra_tables=[TableConfig(name="short", capacity=1000, sequence_length=2)],
        layout="nested",
    )
    with pytest.raises(SpecMismatchError, match="layout: requested 'nested', stored 'packed'"):
        other.load_replay_buffer()


@pytest.mark.heavy
def test_replay_server_and_shards_with_a_packed_config(
    tmp_path: Any, steps: list[Any], data_spec: Any
) -> None:
    with open(CARTPOLE_CONFIG) as f:
        text = f.read()
    config = tmp_path / "packed.toml"
    config.write_text(
        text.replace("sequence_length = 2\n", 'sequence_length = 2\nlayout = "packed"\n')
    )
    assert load_config(config).table.layout == "packed"
    servers = []
    for i in range(2):
        port = pick_free_port()
        servers.append(
            (
                ServerProcess(
                    f"--config={config}",
                    f"--port={port}",
                    f"--checkpoint_dir={tmp_path / f'server{i}'}",
                    "--checkpoint_interval_s=0",
                ),
                f"localhost:{port}",
            )
        )
    try:
        for server, _ in servers:
            server.wait_listening()
        address = servers[0][1]
        info = reverb.Client(address).server_info(timeout=5)["uniform_table"]
        assert info.signature.dtype == tf.uint8
        # An operator sees the layout before attaching TF-Agents' observers with a plain client.
        status = subprocess.run(
            [
                os.path.join(os.path.dirname(sys.executable), "replay-server"),
                "status",
                f"--address={address}",
                "--timeout=30",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert status.returncode == 0, status.stderr[-2000:]
        assert "table uniform_table: 0/" in status.stdout
        assert status.stdout.rstrip().splitlines()[1].endswith("remover fifo, layout packed")
        remote = ReplayBufferManager(
            data_spec, 100000, server_address=address, timeouts=FAST_TIMEOUTS, layout="packed"
        )
        try:
            fill(remote, steps[:40])
            count = remote.num_frames()
            assert count > 10
            items = client_items(remote, "uniform_table", count)
            drain(remote.get_dataset(8), items, lambda b: b[0])
        finally:
            remote.close()
        # The default ("auto") follows the server's layout; another one is refused.
        follows = ReplayBufferManager(
            data_spec, 100000, server_address=address, timeouts=FAST_TIMEOUTS
        )
        try:
            follows.load_replay_buffer()
            assert [t.layout for t in follows.tables] == ["packed"]
            assert client_items(follows, "uniform_table", count) == items
            drain(follows.torch_batches(8), items, lambda b: b)
        finally:
            follows.close()
        wrong = ReplayBufferManager(
            data_spec, 100000, server_address=address, timeouts=FAST_TIMEOUTS, layout="nested"
        )
        try:
            with pytest.raises(SpecMismatchError, match="does not match"):
                wrong.load_replay_buffer()
        finally:
            wrong.close()

        sharded = ShardedReplayBuffer(
            ShardedConfig(tuple(a for _, a in servers)),
            data_spec,
            100000,
            timeouts=FAST_TIMEOUTS,
            layout="packed",
        )
        with sharded.create(overwrite=True):
            for collector in range(2):
                observer = sharded.observer(collector)
                for trajectory in steps[collector * 50 : collector * 50 + 50]:
                    observer(trajectory)
                observer.flush()
            expected = set()
            for index, manager in enumerate(sharded.managers):
                expected |= client_items(manager, "uniform_table", manager.num_frames())
                assert manager.table_config.layout == "packed", index
            drain(sharded.get_dataset(batch_size=16, seed=1), expected, lambda b: b[0])
    finally:
        for server, _ in servers:
            server.finish()


def _foreign_items_are_named_and_left_out_of_the_export(
    manager: ReplayBufferManager, steps: list[Any], make_manager: Any, tmp_path: Any
) -> None:
    """Good items, then TF-Agents' own observer's nested items, written through a plain
    `reverb.Client`, in the packed table: samplers
    name the cause, the export leaves those items out (warning) and keeps every good one."""
    fill(manager, steps[:12])
    good = manager.num_frames()
    good_items = client_items(manager, manager.table_name, good)
    # A plain client (not the manager's `py_client`, whose writers pack) writes nested items.
    plain = reverb.Client(manager.py_client.server_address)
    observer = reverb_utils.ReverbAddTrajectoryObserver(plain, manager.table_name, 2)
    for trajectory in steps[20:26]:
        observer(trajectory)
    observer.flush()
    observer.close()
    assert manager.num_frames() > good  # Reverb took them: nothing checks at insert

    stream = manager.torch_batches(64)
    with pytest.raises(SpecMismatchError, match="ReverbAddTrajectoryObserver") as raised:
        for _ in range(50):
            next(stream)
    assert repr(manager.table_name) in str(raised.value)
    assert "Inconsistent number of tensors" in str(raised.value)
    stream.close()
    with pytest.raises(tf.errors.InvalidArgumentError, match="Inconsistent number of tensors"):
        for _ in range(50):
            next(iter(manager.get_dataset(64)))

    with pytest.warns(UserWarning, match="left out") as warned:
        manager.export(tmp_path / "export")
    assert f"{good} items are read" in str(warned[0].message)
    fresh = make_manager(checkpoint_dir=tmp_path / "fresh", layout="packed")
    fresh.import_buffer(tmp_path / "export")
    assert fresh.num_frames() == good
    assert client_items(fresh, fresh.table_name, good) == good_items
    assert len(batch_items(next(iter(fresh.torch_batches(8))))) == 8


@pytest.mark.heavy
def test_items_of_tf_agents_own_observer_in_a_packed_table_are_named_and_not_exported(
    make_manager: Any, steps: list[Any], tmp_path: Any
) -> None:
    """TF-Agents' observer writes without validating items, so Reverb takes its nested items
    into a packed table (Reverb's server never checks an item against the table signature)."""
    manager = make_manager(layout="packed")
    _foreign_items_are_named_and_left_out_of_the_export(manager, steps, make_manager, tmp_path)


@pytest.mark.heavy
def test_items_of_tf_agents_own_observer_on_a_packed_replay_server(
    make_manager: Any, steps: list[Any], data_spec: Any, tmp_path: Any
) -> None:
    with open(CARTPOLE_CONFIG) as f:
        text = f.read()
    config = tmp_path / "packed.toml"
    config.write_text(
        text.replace("sequence_length = 2\n", 'sequence_length = 2\nlayout = "packed"\n')
    )
    port = pick_free_port()
    server = ServerProcess(
        f"--config={config}",
        f"--port={port}",
        f"--checkpoint_dir={tmp_path / 'server'}",
        "--checkpoint_interval_s=0",
    )
    try:
        server.wait_listening()
        remote = ReplayBufferManager(
            data_spec,
            100000,
            server_address=f"localhost:{port}",
            timeouts=FAST_TIMEOUTS,
            layout="packed",
        )
        try:
            _foreign_items_are_named_and_left_out_of_the_export(
                remote, steps, make_manager, tmp_path
            )
        finally:
            remote.close()
    finally:
        server.finish()


def _tf_agents_observers(client: Any, table: str) -> list[Any]:
    """TF-Agents' own observers, as its examples build them, on `client`."""
    return [
        reverb_utils.ReverbAddTrajectoryObserver(client, table, 3, stride_length=2),
        reverb_utils.ReverbAddTrajectoryObserver(
            client, table, 3, pad_end_of_episodes=True, tile_end_of_episodes=True
        ),
        reverb_utils.ReverbTrajectorySequenceObserver(client, table, 3),
    ]


@pytest.mark.heavy
def test_tf_agents_own_observers_on_the_managers_clients_write_packed_items(
    make_manager: Any, tmp_path: Any, steps: list[Any]
) -> None:
    """`py_client` and the TF-Agents replay buffer's `py_client` of a packed buffer pack what
    TF-Agents' observers append: the packed table holds exactly the nested table's items, and
    every reader reads them."""
    got, frames = {}, {}
    for layout in ("nested", "packed"):
        manager = make_manager(
            checkpoint_dir=str(tmp_path / layout), sequence_length=3, layout=layout
        )
        replay_buffer, _ = manager.create_replay_buffer()
        for client in (manager.py_client, replay_buffer.py_client):
            assert isinstance(client, reverb.Client)
            for observer in _tf_agents_observers(client, manager.table_name):
                for trajectory in steps:
                    observer(trajectory)
                observer.flush()
                observer.close()
        frames[layout] = manager.num_frames()
        got[layout] = client_items(manager, manager.table_name, frames[layout])
        assert len(got[layout]) > 50
        if layout == "packed":
            drain(manager.torch_batches(16), got["nested"], lambda b: b)
            drain(manager.get_dataset(16), got["nested"], lambda b: b[0])
    assert got["packed"] == got["nested"]
    assert frames["packed"] == frames["nested"]


def test_the_packing_client_refuses_what_it_cannot_pack(
    make_manager: Any, steps: list[Any]
) -> None:
    """Items a packed table cannot store are refused at the writer, naming the cause, and
    nothing enters the table."""
    manager = make_manager(sequence_length=3, layout="packed")
    manager.create_replay_buffer()
    client = manager.py_client
    writer = client.trajectory_writer(4)
    with pytest.raises(RuntimeError, match="before `append`"):
        writer.history  # noqa: B018
    for trajectory in steps[:4]:
        writer.append(trajectory)
    history = writer.history
    with pytest.raises(SpecMismatchError, match="sequence_length=3 steps; this item has 2"):
        writer.create_item(manager.table_name, 1.0, tree.map_structure(lambda h: h[-2:], history))
    with pytest.raises(SpecMismatchError, match="one squeezed step"):
        writer.create_item(manager.table_name, 1.0, tree.map_structure(lambda h: h[-1], history))
    with pytest.raises(SpecMismatchError, match="takes every field"):
        writer.create_item(manager.table_name, 1.0, {"obs": history.observation[-3:]})
    window = tree.map_structure(lambda h: h[-3:], history)
    mixed = window._replace(observation=history.observation[-4:-1])
    with pytest.raises(SpecMismatchError, match="same steps"):
        writer.create_item(manager.table_name, 1.0, mixed)
    with pytest.raises(SpecMismatchError, match="no table 'other'"):
        writer.create_item("other", 1.0, window)
    bad = steps[0]._replace(reward=np.float64(1.0))
    with pytest.raises(SpecMismatchError, match="'reward'"):
        writer.append(bad)
    with pytest.raises(SpecMismatchError, match="partial_step"):
        writer.append(steps[0], partial_step=True)
    for call in (
        lambda: client.writer(3),
        lambda: client.insert(steps[0], {manager.table_name: 1.0}),
        lambda: client.structured_writer([]),
    ):
        with pytest.raises(SpecMismatchError, match="cannot read"):
            call()
    writer.end_episode()
    writer.close()
    assert manager.num_frames() == 0


def test_bad_layouts_are_refused(make_manager: Any, data_spec: Any, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"layout must be one of \['auto', 'nested', 'packed'\]"):
        make_manager(layout="columnar")
    with pytest.raises(ConfigError, match="one layout"):
        make_manager(layout="nested", extra_tables=[TableConfig(name="b", layout="packed")])
    with pytest.raises(ConfigError, match="local backend"):
        make_manager(layout="packed", backend="local")
    # Extra tables left at the default take the manager's layout.
    manager = make_manager(layout="packed", extra_tables=[TableConfig(name="b")])
    assert [t.layout for t in manager.tables] == ["packed", "packed"]
    config = tmp_path / "c.toml"
    config.write_text(
        '[table]\nlayout = "packed"\n[[extra_tables]]\nname = "b"\n'
        '[data_spec]\nenv = "CartPole-v0"\n'
    )
    assert [t.layout for t in load_config(config).tables] == ["packed", "packed"]


def test_pack_and_unpack_round_trip_every_dtype() -> None:
    from replay_service.specs.arrays import ArraySpec
    from replay_service.specs.windows import Masked

    spec = Masked(
        step={
            "a": ArraySpec((2, 3), np.float64, "a"),
            "b": ArraySpec((), np.int8, "b"),
            "c": ArraySpec((4,), np.uint8, "c"),
            "d": ArraySpec((), np.bool_, "d"),
            "e": ArraySpec((1,), np.float16, "e"),
        },
        mask=ArraySpec((), np.bool_, "mask"),
    )
    layout = packed.PackedLayout(spec)
    assert layout.step_bytes == 48 + 1 + 4 + 1 + 2 + 1
    rng = np.random.default_rng(1)
    steps = [
        Masked(
            step={
                "a": rng.normal(size=(2, 3)),
                "b": np.int8(-i),
                "c": rng.integers(0, 255, 4).astype(np.uint8),
                "d": np.bool_(i % 2),
                "e": np.array([i / 3], np.float16),
            },
            mask=np.bool_(i != 2),
        )
        for i in range(5)
    ]
    rows = np.stack([layout.pack_nest(s) for s in steps])
    back = layout.unpack(rows)
    tf_back = layout.unpack_tf(tf.constant(rows[None]))
    for i, step in enumerate(steps):
        for x, y, z in zip(
            tree.flatten(step), tree.flatten(back), tree.flatten(tf_back), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), y[i])
            np.testing.assert_array_equal(np.asarray(x), z.numpy()[0, i])
    columns = [
        np.stack([np.asarray(leaf) for leaf in col])
        for col in zip(*map(tree.flatten, steps), strict=True)
    ]
    np.testing.assert_array_equal(layout.pack_items(columns), rows)
    with pytest.raises(ValueError, match="field 'step/b'"):
        layout.pack_nest(steps[0]._replace(step={**steps[0].step, "b": np.int16(1)}))
    with pytest.raises(ValueError, match=r"uint8\[..., 57\]"):
        layout.unpack(rows[:, :10])
    # copy=True (the torch path): the same values, every leaf contiguous and owning its data.
    copies = layout.unpack_leaves(rows, copy=True)
    for leaf, view in zip(copies, tree.flatten(back), strict=True):
        np.testing.assert_array_equal(leaf, view)
        assert leaf.flags.c_contiguous and not np.shares_memory(leaf, rows)
    with pytest.raises(ValueError, match=r"uint8\[..., 57\]"):
        layout.unpack_leaves(rows.astype(np.int8), copy=True)
    # leaf (one field of some rows, e.g. one step of every item): a copy of only those bytes.
    for index, view in enumerate(tree.flatten(back)):
        one = layout.leaf(rows[1:3], index)
        np.testing.assert_array_equal(one, view[1:3])
        assert one.flags.c_contiguous and not np.shares_memory(one, rows)
    with pytest.raises(ValueError, match=r"uint8\[..., 57\]"):
        layout.leaf(rows[:, :10], 0)


def test_packed_observer_names_a_wrong_field(make_manager: Any, steps: list[Any]) -> None:
    manager = make_manager(layout="packed")
    _, observer = manager.create_replay_buffer()
    observer(steps[0])
    bad = steps[1]._replace(observation=np.zeros(3, np.float32))
    with pytest.raises(SpecMismatchError, match="observation"):
        observer(bad)


def test_chunk_length_is_bounded_by_bytes() -> None:
    assert packed.chunk_length(40) == packed.MAX_CHUNK_LENGTH
    assert packed.chunk_length(84 * 84 * 4 + 28) == 1
    assert 1 <= packed.chunk_length(1000) <= packed.MAX_CHUNK_LENGTH


def test_transition_writer_standalone_on_a_packed_server(make_manager: Any, data_spec: Any):
    manager = make_manager(layout="packed")
    manager.create_replay_buffer()
    writer = TransitionWriter(manager.py_client, manager.table_name, 2, data_spec, layout="packed")
    writer.add(np.zeros(4), 1, 1.0, np.ones(4), False)
    writer.add(np.ones(4), 0, 1.0, np.full(4, 2.0), True)
    writer.close()
    assert manager.num_frames() == 2


@pytest.fixture()
def confirming(monkeypatch: Any) -> list[Any]:
    """The packed writers whose confirming `end_episode` was called, one entry per call."""
    calls: list[Any] = []
    original = PackedWindowWriter.end_episode

    def end_episode(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(PackedWindowWriter, "end_episode", end_episode)
    return calls


def test_episode_ends_do_not_wait_and_close_confirms_every_item(
    make_manager: Any, tmp_path: Any, confirming: list[Any]
) -> None:
    """At an episode boundary the packed writers start the next episode without Reverb's
    confirming `end_episode` (one round trip per episode); `close()` still confirms all."""
    rng = np.random.default_rng(3)
    counts = {}
    for layout in ("nested", "packed"):
        manager = make_manager(checkpoint_dir=str(tmp_path / layout), layout=layout)
        manager.create_replay_buffer()
        writer = manager.transition_writer()
        for _ in range(30):  # two transitions per episode: 2 windows of 2 steps
            s0, s1, s2 = rng.normal(size=(3, 4))
            writer.add(s0, 0, 1.0, s1, False)
            writer.add(s1, 1, 1.0, s2, True)
        assert not confirming
        writer.close()
        counts[layout] = manager.num_frames()
    assert len(confirming) == 1  # the packed writer's close
    assert counts == {"nested": 60, "packed": 60}


@pytest.mark.heavy
def test_observer_episode_ends_do_not_wait_and_close_confirms(
    make_manager: Any, tmp_path: Any, steps: list[Any], confirming: list[Any]
) -> None:
    assert sum(int(t.step_type) == 2 for t in steps) >= 2  # episodes end inside
    counts = {}
    for layout in ("nested", "packed"):
        manager = make_manager(checkpoint_dir=str(tmp_path / layout), layout=layout)
        _, observer = manager.create_replay_buffer()
        for trajectory in steps:
            observer(trajectory)
        assert not confirming
        observer.close()
        counts[layout] = manager.num_frames()
    assert len(confirming) == 1
    assert counts["packed"] == counts["nested"] > 100


def test_the_default_layout_is_packed_for_a_new_buffer_and_the_stored_one_on_restore(
    make_manager: Any, tmp_path: Any, steps: list[Any]
) -> None:
    """layout="auto": a new embedded buffer is packed; a directory holding a nested buffer
    restores nested, with every item."""
    new = make_manager(checkpoint_dir=str(tmp_path / "new"))
    assert [t.layout for t in new.tables] == ["packed"]
    fill(new, steps[:30])
    assert new.py_client.server_info()[new.table_name].signature.dtype == tf.uint8
    old = make_manager(checkpoint_dir=str(tmp_path / "old"), layout="nested")
    fill(old, steps[:30])
    items = client_items(old, old.table_name, old.num_frames())
    old.checkpoint()
    old.close()
    again = make_manager(checkpoint_dir=str(tmp_path / "old"))
    assert again.table_config.layout == "nested"
    again.load_replay_buffer()
    assert client_items(again, again.table_name, len(items)) == items


def test_packed_items_reach_the_server_without_a_flush(make_manager: Any, steps: list[Any]) -> None:
    """The sender pushes a packed writer's items out at episode ends and soon after each
    step, without anyone flushing: a plain count of the server sees all of them."""
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    for trajectory in steps[:10]:  # within one chunk, mid-episode or not
        observer(trajectory)
    expected = sum(1 for a, _ in itertools.pairwise(steps[:10]) if not a.is_last())
    deadline = time.monotonic() + 10
    while manager.py_client.server_info()[manager.table_name].current_size < expected:
        assert time.monotonic() < deadline, "items stayed unsent"
        time.sleep(0.01)
    assert manager.num_frames() == expected


@pytest.mark.heavy
def test_replay_server_restores_a_managers_default_buffer_in_its_layout(
    make_manager: Any, data_spec: Any, tmp_path: Any, steps: list[Any]
) -> None:
    """A buffer made by `ReplayBufferManager(data_spec, ...)` (packed) is served by
    `replay-server --restore_if_exists` with a config that names no layout, and a remote
    manager's default reads every item."""
    root = tmp_path / "buffer"
    manager = make_manager(checkpoint_dir=str(root), capacity=100000)
    fill(manager, steps)
    items = client_items(manager, manager.table_name, manager.num_frames())
    manager.checkpoint()
    manager.close()
    port = pick_free_port()
    server = ServerProcess(
        f"--config={CARTPOLE_CONFIG}",
        f"--port={port}",
        f"--checkpoint_dir={root}",
        "--checkpoint_interval_s=0",
        "--restore_if_exists",
    )
    try:
        server.wait_listening()
        text = "".join(server.output)
        assert "restoring" in text and "'packed' layout" in text, text
        remote = ReplayBufferManager(
            data_spec, 100000, server_address=f"localhost:{port}", timeouts=FAST_TIMEOUTS
        )
        try:
            remote.load_replay_buffer()
            assert remote.table_config.layout == "packed"
            assert client_items(remote, remote.table_name, len(items)) == items
        finally:
            remote.close()
    finally:
        server.finish()


def test_tf_agents_observer_items_reach_the_server_mid_episode(
    make_manager: Any, steps: list[Any]
) -> None:
    """Items of TF-Agents' own observer on `py_client` are sent as the packed writers' are:
    mid-episode, without a flush, as a nested table gets them (they had waited in the open
    chunk of 64 steps: none visible to samplers, `num_frames()` or a checkpoint)."""
    first_episode = list(itertools.takewhile(lambda t: not t.is_boundary(), steps))[:10]
    assert len(first_episode) == 10
    manager = make_manager(sequence_length=2)
    manager.create_replay_buffer()
    observer = reverb_utils.ReverbAddTrajectoryObserver(manager.py_client, manager.table_name, 2)
    for trajectory in first_episode:
        observer(trajectory)
    deadline = time.monotonic() + 10
    while manager.py_client.server_info()[manager.table_name].current_size < 9:
        assert time.monotonic() < deadline, "the observer's items stayed unsent"
        time.sleep(0.01)
    observer.close()
    assert manager.num_frames() == 9


_EXIT_SCRIPT = """
import tempfile
from tf_agents.drivers import py_driver
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy
from tf_agents.replay_buffers import reverb_utils
from replay_service import ReplayBufferManager
from replay_service.specs.nests import collect_data_spec

env = suite_gym.load("CartPole-v0")
policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)
steps = []
py_driver.PyDriver(env, policy, [steps.append], max_steps=60).run(env.reset())
manager = ReplayBufferManager(collect_data_spec(env, policy), 100000, tempfile.mkdtemp())
manager.create_replay_buffer()
writers = [manager.observer() for _ in range(40)]
writers += [
    reverb_utils.ReverbAddTrajectoryObserver(manager.py_client, manager.table_name, 2)
    for _ in range(10)
]
for _ in range(3):
    for trajectory in steps:
        for writer in writers:
            writer(trajectory)
print("done", flush=True)
"""


@pytest.mark.heavy
def test_a_process_with_packed_writers_left_open_exits_cleanly(tmp_path: Any) -> None:
    """A script that leaves its packed writers and its manager open exits with status 0:
    the sender thread ends at exit before the interpreter finalizes (it was inside Reverb's
    flush then and the process aborted, "terminate called without an active exception")."""
    result = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert "done" in result.stdout, result.stderr[-3000:]
    assert "terminate called" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
