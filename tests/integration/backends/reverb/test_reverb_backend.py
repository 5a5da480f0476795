"""`ReverbBackend` (what the embedded and remote modes share) attached to a real Reverb server:
it checks the server's tables against the buffer naming every difference, hands users a
bounded or packing client, writes items, reads table sizes and limiters, describes its tables
for torch sources and serves whole items through tf.data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import reverb

from replay_service.backends.base import BackendOptions, Capability, Lifeline
from replay_service.backends.reverb.backend import ReverbBackend, options_layout
from replay_service.backends.reverb.bounded_client import BoundedClient
from replay_service.backends.reverb.packing_client import PackingClient
from replay_service.backends.reverb.remote import RemoteBackend
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import SamplingConfig, TableConfig, Timeouts
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.sample.view import DatasetRequest
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.layouts import NestedLayout
from replay_service.specs.packed import PackedLayout
from replay_service.storage.export import ExportedItems

SPEC = {"obs": ArraySpec((2,), np.float32), "action": ArraySpec((), np.int64)}
TIMEOUTS = Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0)
PRIMARY = TableConfig("primary", 50, 2, sampling=SamplingConfig(min_size_to_sample=2))
EXTRA = TableConfig("extra", 50, 2, sampling=SamplingConfig(sampler="fifo"))
PACKED = TableConfig("packed", 50, 2, layout="packed")


@pytest.fixture(scope="module")
def client() -> Iterator[reverb.Client]:
    tables = [make_table(t, SPEC) for t in (PRIMARY, EXTRA, PACKED)]
    server = reverb.Server([*tables, reverb.Table.queue("unsigned", 5)], port=None)
    yield reverb.Client(f"localhost:{server.port}")
    server.stop()


def backend(client: reverb.Client, *tables: TableConfig, spec: Any = SPEC) -> ReverbBackend:
    """The shared backend on the module's server, through its remote mode (which only
    connects)."""
    options = BackendOptions(
        tables or (PRIMARY, EXTRA), spec, spec, TIMEOUTS, server_address=client.server_address
    )
    shared = RemoteBackend.from_options(options)
    shared.load()
    return shared


def items(count: int) -> ExportedItems:
    action = np.arange(count * 2, dtype=np.int64).reshape(count, 2)
    return ExportedItems(
        data=[action, np.stack([action, -action], -1).astype(np.float32)],
        priorities=np.ones(count),
        times_sampled=np.zeros(count, np.int32),
    )


def test_options_take_the_primary_tables_layout() -> None:
    assert isinstance(
        options_layout(BackendOptions((PRIMARY,), SPEC, SPEC, TIMEOUTS)), NestedLayout
    )
    packed = options_layout(BackendOptions((PACKED, PRIMARY), SPEC, SPEC, TIMEOUTS))
    assert isinstance(packed, PackedLayout) and packed.step_bytes == 16
    with pytest.raises(ConfigError, match="columnar"):
        TableConfig("t", 5, 1, layout="columnar")


def test_way_out_names_what_to_use_instead() -> None:
    assert ReverbBackend.way_out(Capability.SEEDED_SAMPLING) == "it applies only to backend='local'"
    assert "torch_batches(table=...)" in ReverbBackend.way_out(Capability.RECENT_SAMPLING)
    assert "embedded Reverb server" in ReverbBackend.way_out(Capability.TRAIN_SCHEDULE)


def test_matching_tables_open_a_buffer_whose_client_is_bounded(client) -> None:
    buffer = backend(client).open_buffer(client, lambda: None)
    assert isinstance(buffer.py_client, BoundedClient)
    assert not isinstance(buffer.py_client, PackingClient)
    assert buffer.py_client.timeouts == TIMEOUTS
    packed = backend(client, PACKED)
    packing = packed.open_buffer(client, lambda: None).py_client
    assert isinstance(packing, PackingClient) and packing.layout is packed.layout
    assert backend(client).users_client(packing) is packing  # already bounded: kept


@pytest.mark.parametrize(
    ("tables", "spec", "match"),
    [
        ((TableConfig("missing", 50, 2),), SPEC, r"has no table 'missing'; its tables are \["),
        (
            (TableConfig("primary", 99, 2),),
            SPEC,
            r"table 'primary' .*capacity: requested 99, "
            "found 50",
        ),
        ((TableConfig("primary", 50, 3),), SPEC, r"does not match this manager .*action"),
        (
            (PRIMARY,),
            {"obs": ArraySpec((3,), np.float32), "action": ArraySpec((), np.int64)},
            r"'obs'",
        ),
        ((TableConfig("unsigned", 5, 1),), SPEC, r"table 'unsigned' at '.*' has no signature"),
        (
            (TableConfig("primary", 50, 2, layout="packed"),),
            SPEC,
            r"does not match this manager .*packed",
        ),
    ],
)
def test_a_table_that_differs_from_the_buffer_is_refused_naming_it(
    client, tables, spec, match
) -> None:
    with pytest.raises(SpecMismatchError, match=match):
        backend(client, *tables, spec=spec).open_buffer(client, lambda: None)


def test_inserted_items_are_counted_and_the_limiter_read_from_the_server(client) -> None:
    shared = backend(client)
    client.reset("extra")
    assert shared.num_items(client, "extra") == 0
    shared.insert_items(EXTRA, items(3))
    assert shared.num_items(client, "extra") == 3
    state = shared.limiter_state("primary")
    assert state.min_size_to_sample == 2 and state.size == 0
    assert shared.limiter_state("extra").inserts >= 3
    with pytest.raises(SpecMismatchError, match="has no table 'gone'"):
        shared.num_items(client, "gone")


def test_table_handles_and_torch_sources_describe_this_server(client) -> None:
    shared = backend(client)
    handle = shared.table_handle(EXTRA)
    assert handle.server_address == client.server_address and handle.table is EXTRA
    assert handle.timeouts == TIMEOUTS and handle.stored_spec == SPEC
    lifeline = Lifeline()

    class Buffer:
        pass

    buffer = Buffer()
    buffer.lifeline = lifeline  # type: ignore[attr-defined]
    source = shared.torch_source(buffer, EXTRA)
    assert source.table_name == "extra" and source.ordered and source.lifeline is lifeline
    shared.note_clear(buffer)
    assert source.clears() == 1


@pytest.mark.heavy
def test_whole_items_are_served_through_tf_data(client) -> None:
    shared = backend(client)
    client.reset("extra")
    shared.insert_items(EXTRA, items(4))
    buffer = shared.open_buffer(client, lambda: None)
    request = DatasetRequest(EXTRA, 3, None, 1, 1)
    data, info = next(iter(shared.dataset(buffer, request)))
    action = data["action"].numpy()
    assert action.shape == (3, 2) and data["obs"].shape == (3, 2, 2)
    assert action[:, 0].tolist() == [0, 0, 0]  # FIFO without removal: the oldest item
    np.testing.assert_array_equal(data["obs"].numpy()[..., 1], -action)
    assert info.key.shape[0] == 3
