"""`pipeline`: the tf.data read pipeline of one table, its `as_dataset` element structure and
its bounds; on a real Reverb server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import reverb
import tensorflow as tf
import tree

from replay_service.backends.reverb.layout_writers import window_writer
from replay_service.backends.reverb.pipeline import (
    default_in_flight,
    read_pipeline,
    sample_dataset,
    splitter,
)
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.nests import table_signature

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
LENGTH = 2
ONCE = SamplingConfig(sampler="fifo", remover="fifo", max_times_sampled=1)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    tables = [
        TableConfig(name="nested", capacity=100, sequence_length=LENGTH),
        TableConfig(name="packed", capacity=100, sequence_length=LENGTH, layout="packed"),
        TableConfig(name="ordered", capacity=100, sequence_length=LENGTH, sampling=ONCE),
        TableConfig(name="empty", capacity=100, sequence_length=LENGTH),
    ]
    server = reverb.Server([make_table(t, SPEC) for t in tables], port=None)
    client = reverb.Client(f"localhost:{server.port}")
    for table in ("nested", "packed", "ordered"):
        layout = resolve_layout(table if table == "packed" else "nested", SPEC)
        writer = window_writer(client, [(table, LENGTH, 1, 1.0, False)], layout, 5000)
        for value in range(9):
            writer.append(tree.map_structure(lambda s, v=value: np.full(s.shape, v, s.dtype), SPEC))
        writer.end_episode(timeout_ms=5000)
        if table == "packed":
            writer.close()
    yield f"localhost:{server.port}"
    server.stop()


def _first(dataset: tf.data.Dataset) -> Any:
    return next(iter(dataset))


def test_in_flight_is_four_batches_and_at_least_64() -> None:
    assert default_in_flight(1) == 64
    assert default_in_flight(16) == 64
    assert default_in_flight(100) == 400


def test_the_splitter_broadcasts_the_info_over_the_steps() -> None:
    info = reverb.SampleInfo(
        key=tf.constant([1, 2], tf.uint64),
        probability=tf.constant([0.5, 0.25], tf.float64),
        table_size=tf.constant([4, 4], tf.int64),
        priority=tf.constant([1.0, 2.0], tf.float64),
        times_sampled=tf.constant([0, 3], tf.int32),
    )
    data, spread = splitter(3)(reverb.ReplaySample(info=info, data="data"))
    assert data == "data"
    assert spread.key.numpy().tolist() == [[1, 1, 1], [2, 2, 2]]
    assert spread.times_sampled.shape == (2, 3)


@pytest.mark.heavy
@pytest.mark.parametrize("table", ["nested", "packed"])
def test_sample_dataset_gives_as_dataset_batches_on_both_layouts(address: str, table: str) -> None:
    layout = resolve_layout(table, SPEC)
    dataset = sample_dataset(address, table, SPEC, LENGTH, 5, sample_timeout=5.0, layout=layout)
    data, info = _first(dataset)
    assert data.observation.shape == (5, LENGTH, 2)
    assert data.action.dtype == tf.int64
    # Every item is two consecutive steps: step k holds k in every field.
    steps = data.step_type.numpy()
    np.testing.assert_array_equal(steps[:, 1], steps[:, 0] + 1)
    np.testing.assert_array_equal(data.observation.numpy()[:, :, 0], steps)
    assert info.key.shape == (5, LENGTH)


@pytest.mark.heavy
def test_packed_rows_can_be_left_packed(address: str) -> None:
    layout = resolve_layout("packed", SPEC)
    batch = _first(
        read_pipeline(
            address,
            "packed",
            table_signature(SPEC, LENGTH),
            3,
            sample_timeout=5.0,
            layout=layout,
            unpack=False,
        )
    )
    rows = batch.data.numpy()
    assert rows.dtype == np.uint8 and rows.shape == (3, LENGTH, layout.step_bytes)
    (steps,) = layout.decode_columns([rows])[:1]
    np.testing.assert_array_equal(steps[:, 1], steps[:, 0] + 1)


@pytest.mark.heavy
def test_one_worker_keeps_the_order_of_a_fifo_table(address: str) -> None:
    batch = _first(
        read_pipeline(
            address,
            "ordered",
            table_signature(SPEC, LENGTH),
            4,
            sample_timeout=5.0,
            num_workers=1,
            layout=resolve_layout("nested", SPEC),
        )
    )
    assert batch.data.step_type.numpy()[:, 0].tolist() == [0, 1, 2, 3]


@pytest.mark.heavy
def test_an_empty_table_raises_naming_it_within_the_timeout(address: str) -> None:
    dataset = sample_dataset(
        address, "empty", SPEC, LENGTH, 2, sample_timeout=0.3, layout=resolve_layout("nested", SPEC)
    )
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"no item could be sampled from table .*empty.* within 0.3 s",
    ):
        _first(dataset)
