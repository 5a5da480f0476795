"""`PackingClient` on a real packed-layout Reverb server, without a manager: its trajectory
writers pack each appended step into one row and turn history windows into items of those
rows, keep enough history for the longest table whatever `num_keep_alive_refs` asks, carry the
client's write bound, and the client pickles with its layout, tables and timeouts. (What the
writer refuses is checked through the manager in tests/integration/specs/test_packed.py.)"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import reverb

from replay_service.backends.reverb.packing_client import PackingClient, PackingTrajectoryWriter
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import SamplingConfig, TableConfig, Timeouts
from replay_service.errors import SpecMismatchError, WriteTimeoutError
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.layouts import NestedLayout
from replay_service.specs.packed import PackedLayout

SPEC = {"obs": ArraySpec((2,), np.float32), "action": ArraySpec((), np.int64)}
LAYOUT = PackedLayout(SPEC)
FIFO = SamplingConfig(sampler="fifo", remover="fifo", max_times_sampled=1)  # read once
LENGTHS = {"p3": 3, "p2": 2, "queue": 1}
TIMEOUTS = Timeouts(connect=5.0, write=0.3, sample=1.0, checkpoint=60.0)


@pytest.fixture(scope="module")
def server() -> Iterator[reverb.Server]:
    tables = [
        make_table(TableConfig(name, 100, length, sampling=FIFO, layout="packed"), SPEC)
        for name, length in LENGTHS.items()
        if name != "queue"
    ]
    server = reverb.Server([*tables, reverb.Table.queue("queue", 1)], port=None)
    yield server
    server.stop()


@pytest.fixture()
def client(server: reverb.Server) -> PackingClient:
    client = PackingClient(reverb.Client(f"localhost:{server.port}"), LAYOUT, LENGTHS, TIMEOUTS)
    for name in LENGTHS:
        client.reset(name)
    return client


def step(v: int) -> dict[str, np.ndarray]:
    return {"obs": np.array([v, -v], np.float32), "action": np.int64(v)}


def window(writer: PackingTrajectoryWriter, length: int) -> dict[str, object]:
    history = writer.history
    return {key: column[-length:] for key, column in history.items()}


def items(client: PackingClient, table: str) -> list[list[int]]:
    """The actions of each item of `table`, oldest first, read from its packed rows."""
    size = client.server_info()[table].current_size
    out = []
    for sample in client.sample(table, num_samples=size):
        rows = np.stack([timestep.data[0] for timestep in sample])  # a sample's steps
        assert rows.dtype == np.uint8 and rows.shape == (LENGTHS[table], LAYOUT.step_bytes)
        unpacked = LAYOUT.unpack(rows)
        np.testing.assert_array_equal(unpacked["obs"][:, 0], unpacked["action"])
        np.testing.assert_array_equal(unpacked["obs"][:, 1], -unpacked["action"])
        out.append(unpacked["action"].tolist())
    return out


def test_windows_of_the_history_become_items_of_packed_rows(client: PackingClient) -> None:
    with client.trajectory_writer(3) as writer:
        for v in range(5):
            writer.append(step(v))
            if writer.episode_steps >= 3:
                writer.create_item("p3", 1.0, window(writer, 3))
            if writer.episode_steps >= 2:
                writer.create_item("p2", 1.0, window(writer, 2))
        writer.end_episode()
        assert writer.episode_steps == 0
        writer.append(step(10))
        writer.append(step(11))
        writer.create_item("p2", 1.0, window(writer, 2))
    # Leaving the `with` block flushes the writer: every item is on the server.
    assert items(client, "p3") == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert items(client, "p2") == [[0, 1], [1, 2], [2, 3], [3, 4], [10, 11]]


def test_the_history_keeps_the_longest_item_whatever_num_keep_alive_refs_asks(
    client: PackingClient,
) -> None:
    writer = client.trajectory_writer(1)
    for v in range(4):
        writer.append(step(v))
    writer.create_item("p3", 1.0, window(writer, 3))
    writer.flush()
    writer.close()
    assert items(client, "p3") == [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"num_keep_alive_refs \(0\) must be a positive integer"):
        client.trajectory_writer(0)


def test_a_flush_the_server_does_not_confirm_times_out_by_the_clients_bound(
    client: PackingClient,
) -> None:
    writer = client.trajectory_writer(1)
    for v in range(2):  # a queue of one item: the second insert waits
        writer.append(step(v))
        writer.create_item("queue", 1.0, window(writer, 1))
    with pytest.raises(WriteTimeoutError, match=r"not confirmed within 300 ms \(Timeouts.write\)"):
        writer.flush()
    writer.close()


def test_window_writers_need_the_packed_layout(client: PackingClient) -> None:
    with pytest.raises(
        SpecMismatchError,
        match=r"Client.structured_writer\(\) writes one column "
        r"per field, which a layout='packed' table cannot read",
    ):
        client.window_writer([], NestedLayout(SPEC), timeout_ms=1000)


def test_a_pickled_client_reconnects_with_its_layout_tables_and_bounds(
    client: PackingClient,
) -> None:
    copy = pickle.loads(pickle.dumps(client))
    assert isinstance(copy, PackingClient)
    assert repr(copy) == f"PackingClient, server_address={client.server_address}"
    assert copy.timeouts == TIMEOUTS and copy.layout.step_bytes == LAYOUT.step_bytes
    with copy.trajectory_writer(2) as writer:
        writer.append(step(7))
        writer.append(step(8))
        writer.create_item("p2", 1.0, window(writer, 2))
    assert items(client, "p2") == [[7, 8]]
