"""`transfer`: an import writes items back in order, sharing repeated steps, and an export
reads every item of a checkpoint exactly once, oldest first; on a real Reverb server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import reverb

from conftest import FAST_TIMEOUTS
from replay_service.backends.reverb.bounded_client import BoundedClient
from replay_service.backends.reverb.handles import TableHandle
from replay_service.backends.reverb.tables import make_table
from replay_service.backends.reverb.transfer import _continues_previous, insert_items, read_items
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.nests import describe_spec
from replay_service.storage.export import ExportedItems

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
LENGTH = 3
FIFO = SamplingConfig(sampler="fifo", remover="fifo")
TABLES = {
    layout: TableConfig(
        name=layout, capacity=50, sequence_length=LENGTH, sampling=FIFO, layout=layout
    )
    for layout in ("nested", "packed")
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[reverb.Server, Path]]:
    root = tmp_path_factory.mktemp("transfer")
    checkpointer = reverb.checkpointers.DefaultCheckpointer(str(root))
    server = reverb.Server(
        [make_table(t, SPEC) for t in TABLES.values()], port=None, checkpointer=checkpointer
    )
    yield server, root
    server.stop()


@pytest.fixture()
def client(server: tuple[reverb.Server, Path]) -> BoundedClient:
    client = BoundedClient(reverb.Client(f"localhost:{server[0].port}"), FAST_TIMEOUTS)
    for name in TABLES:
        client.reset(name)
    return client


def _steps(values: list[float]) -> list[np.ndarray]:
    """One array per field of SPEC: step i of every field holds values[i]."""
    return [
        np.stack([np.full(f["shape"], v, f["dtype"]) for v in values]) for f in describe_spec(SPEC)
    ]


def _windows(starts: list[int]) -> ExportedItems:
    """Items whose steps are start, start+1, ..., start+LENGTH-1."""
    per_item = [_steps([s + k for k in range(LENGTH)]) for s in starts]
    data = [np.stack([item[f] for item in per_item]) for f in range(len(per_item[0]))]
    return ExportedItems(
        data=data,
        priorities=np.arange(1.0, len(starts) + 1.0),
        times_sampled=np.zeros([len(starts)], np.int32),
    )


def _handle(client: BoundedClient, table: TableConfig) -> TableHandle:
    return TableHandle(
        server_address=client.server_address,
        table=table,
        stored_spec=SPEC,
        timeouts=FAST_TIMEOUTS,
        layout=resolve_layout(table.layout, SPEC),
    )


def test_consecutive_windows_continue_the_previous_item() -> None:
    items = _windows([0, 1, 2, 10, 11])
    assert _continues_previous(items.data, LENGTH).tolist() == [False, True, True, False, True]


def test_a_single_differing_field_breaks_the_continuation() -> None:
    items = _windows([0, 1, 2])
    items.data[-1][2, 0] = 99.0  # item 2's first step differs only in its last field
    assert _continues_previous(items.data, LENGTH).tolist() == [False, True, False]


def test_nan_steps_continue_by_their_bytes_and_length_one_never_continues() -> None:
    data = [np.full([3, LENGTH], np.nan, np.float32)]
    assert _continues_previous(data, LENGTH).tolist() == [False, True, True]
    assert _continues_previous(data, 1).tolist() == [False, False, False]
    assert _continues_previous([], LENGTH).tolist() == []


def test_object_or_odd_sized_fields_are_never_shared() -> None:
    objects = np.empty([2, LENGTH], dtype=object)
    objects[:] = "x"
    assert _continues_previous([objects], LENGTH).tolist() == [False, False]
    odd = np.zeros([2, LENGTH, 1], dtype="V3")
    assert _continues_previous([odd], LENGTH).tolist() == [False, False]


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["nested", "packed"])
def test_inserted_items_come_back_in_order_with_their_priorities(
    client: BoundedClient, layout: str
) -> None:
    table = TABLES[layout]
    items = _windows([0, 1, 2, 7, 8, 20])
    insert_items(client, table.name, LENGTH, items, FAST_TIMEOUTS, resolve_layout(layout, SPEC))
    assert client.server_info()[table.name].current_size == 6

    back = read_items(_handle(client, table), client.checkpoint())
    assert back.num_items == 6
    np.testing.assert_array_equal(back.priorities, items.priorities)
    np.testing.assert_array_equal(back.times_sampled, np.zeros([6]))
    assert len(back.data) == len(items.data)
    for got, want in zip(back.data, items.data, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.heavy
def test_an_empty_import_writes_nothing(client: BoundedClient) -> None:
    empty = ExportedItems(
        data=[a[:0] for a in _windows([0]).data],
        priorities=np.zeros([0]),
        times_sampled=np.zeros([0], np.int32),
    )
    insert_items(client, "nested", LENGTH, empty, FAST_TIMEOUTS, resolve_layout("nested", SPEC))
    assert client.server_info()["nested"].current_size == 0
    back = read_items(_handle(client, TABLES["nested"]), client.checkpoint())
    assert back.num_items == 0
