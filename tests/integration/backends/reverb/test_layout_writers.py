"""`layout_writers`: a collector's window writer inserts the same windows on a nested table
(Reverb's `StructuredWriter`) as on a packed one, and an import's item writer writes whole
items; on a real Reverb server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import reverb
import tree

from replay_service.backends.reverb.layout_writers import (
    StructuredWindowWriter,
    item_writer,
    window_writer,
)
from replay_service.backends.reverb.packed_writers import EXIT_WAIT_S, PackedWindowWriter
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
# Every item is read once, oldest first.
ONCE = SamplingConfig(sampler="fifo", remover="fifo", max_times_sampled=1)
# (suffix, sequence_length): one table of each per layout.
LENGTHS = {"a": 3, "b": 2, "c": 3}
LAYOUTS = ("nested", "packed")


@pytest.fixture(scope="module")
def client() -> Iterator[reverb.Client]:
    tables = [
        TableConfig(
            name=f"{layout}_{s}", capacity=100, sequence_length=n, sampling=ONCE, layout=layout
        )
        for layout in LAYOUTS
        for s, n in LENGTHS.items()
    ]
    server = reverb.Server([make_table(t, SPEC) for t in tables], port=None)
    yield reverb.Client(f"localhost:{server.port}")
    server.stop()


def _step(value: int) -> Any:
    return tree.map_structure(lambda s: np.full(s.shape, value, s.dtype), SPEC)


def _read(client: reverb.Client, layout: str, table: str) -> list[list[int]]:
    """The step types (the step's value) of every item of `table`, oldest first."""
    count = client.server_info()[table].current_size
    items = []
    for sample in client.sample(table, num_samples=count, emit_timesteps=False):
        data = [np.asarray(column) for column in sample.data]
        if layout == "packed":
            data = resolve_layout(layout, SPEC).decode_columns([data[0][None]])
            data = [column[0] for column in data]
        items.append(data[0].tolist())
    return items


def _write(client: reverb.Client, layout: str, episodes: list[int]) -> list[list[list[int]]]:
    """Writes consecutive values in episodes of the given lengths through the windows
    a: (3 steps, stride 1), b: (2, stride 3), c: (3, stride 2, padded); returns each table's
    items."""
    windows = [
        (f"{layout}_a", 3, 1, 1.0, False),
        (f"{layout}_b", 2, 3, 1.0, False),
        (f"{layout}_c", 3, 2, 1.0, True),
    ]
    writer = window_writer(client, windows, resolve_layout(layout, SPEC), 5000)
    value = 0
    for length in episodes:
        for _ in range(length):
            writer.append(_step(value))
            value += 1
        writer.end_episode(timeout_ms=5000)
    return [_read(client, layout, name) for name, *_ in windows]


def test_nested_and_packed_tables_get_the_same_windows(client: reverb.Client) -> None:
    episodes = [2, 6, 4]
    nested = _write(client, "nested", episodes)
    packed = _write(client, "packed", episodes)
    assert nested == packed
    a, b, c = nested
    # Every window of 3 inside an episode (episode 1 is too short for one).
    assert a == [[2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7], [8, 9, 10], [9, 10, 11]]
    # Every third step, counted across episodes, from the second step of an episode on.
    assert b == [[2, 3], [5, 6], [8, 9]]
    # Padded: windows starting at even step indices of their episode.
    assert c == [[2, 3, 4], [4, 5, 6], [8, 9, 10]]


def test_each_layout_gets_its_writer_with_the_exit_wait_bounded(client: reverb.Client) -> None:
    windows = [("nested_a", 3, 1, 1.0, False)]
    nested = window_writer(client, windows, resolve_layout("nested", SPEC), 2000)
    assert isinstance(nested, StructuredWindowWriter)
    assert nested.next_episode() is False
    packed = window_writer(
        client, [("packed_a", 3, 1, 1.0, False)], resolve_layout("packed", SPEC), 2000
    )
    assert isinstance(packed, PackedWindowWriter)
    assert packed.exit_wait_s() == 2.0
    unbounded = window_writer(
        client, [("packed_a", 3, 1, 1.0, False)], resolve_layout("packed", SPEC), None
    )
    assert unbounded.exit_wait_s() == EXIT_WAIT_S
    packed.close()
    unbounded.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_item_writer_writes_whole_items_in_the_tables_format(
    client: reverb.Client, layout: str
) -> None:
    stored = resolve_layout(layout, SPEC)
    table = f"{layout}_b"
    # One run of three steps, valued 10, 11, 12, as an import encodes it.
    steps = [
        np.stack([np.full(s.shape, v, s.dtype) for v in (10, 11, 12)])[None]
        for s in tree.flatten(SPEC)
    ]
    columns = stored.encode_columns(steps)
    with item_writer(client, stored, 2) as writer:
        for step in range(3):
            writer.append([column[0, step] for column in columns])
            if step >= 1:
                writer.create_item(table, 1.0, [column[-2:] for column in writer.history])
        writer.end_episode(timeout_ms=5000)
    assert _read(client, layout, table) == [[10, 11], [11, 12]]
