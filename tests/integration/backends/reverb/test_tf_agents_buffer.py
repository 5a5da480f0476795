"""`backends.reverb.tf_agents_buffer`: TF-Agents' `ReverbReplayBuffer` reading nested and packed
tables into the data spec, and failing clearly (empty table, stopped sampling, batch too large)
instead of waiting; on a real Reverb server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import reverb
import tensorflow as tf
import tree

from replay_service.backends.reverb.layout_writers import window_writer
from replay_service.backends.reverb.tables import make_table
from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.nests import to_tf_spec

pytestmark = pytest.mark.heavy

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
TF_SPEC = to_tf_spec(SPEC)
LAYOUTS = ("nested", "packed")


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """Tables `nested` and `packed` (6 steps each; step i holds i everywhere) and `empty`."""
    configs = [
        TableConfig(name=name, capacity=100, sequence_length=2, layout=name) for name in LAYOUTS
    ]
    configs.append(TableConfig(name="empty", capacity=100, sequence_length=2, layout="nested"))
    server = reverb.Server([make_table(c, SPEC) for c in configs], port=None)
    client = reverb.Client(f"localhost:{server.port}")
    for name in LAYOUTS:
        writer = window_writer(client, [(name, 2, 1, 1.0, False)], resolve_layout(name, SPEC), 5000)
        for i in range(6):
            writer.append(tree.map_structure(lambda s, i=i: np.full(s.shape, i, s.dtype), SPEC))
        writer.end_episode(timeout_ms=5000)
    yield f"localhost:{server.port}"
    server.stop()


def _buffer(address: str, table: str, layout: str = "nested", **kwargs: object) -> ReplayBuffer:
    return ReplayBuffer(
        TF_SPEC,
        table,
        2,
        sample_timeout=kwargs.pop("sample_timeout", 5.0),
        layout=layout,
        server_address=address,
        **kwargs,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_layouts_read_consecutive_steps_in_the_data_spec(address: str, layout: str) -> None:
    buffer = _buffer(address, layout, layout)
    batch, _ = next(iter(buffer.as_dataset(sample_batch_size=4)))
    assert batch.observation.shape == (4, 2, 2) and batch.observation.dtype == tf.float32
    assert batch.action.dtype == tf.int64
    action = batch.action.numpy()
    np.testing.assert_array_equal(action[:, 1], action[:, 0] + 1)
    np.testing.assert_array_equal(batch.observation.numpy()[..., 0], action.astype(np.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_num_steps_splits_stored_sequences(address: str, layout: str) -> None:
    buffer = _buffer(address, layout, layout)
    batch, _ = next(iter(buffer.as_dataset(sample_batch_size=3, num_steps=1)))
    assert batch.action.shape == (3, 1) and batch.observation.shape == (3, 1, 2)


def test_an_empty_table_fails_within_the_timeout_naming_it(address: str) -> None:
    buffer = _buffer(address, "empty", sample_timeout=0.3)
    start = time.monotonic()
    empty = r"from table .{1,2}empty.{1,2} within 0.3 s"
    with pytest.raises(tf.errors.InvalidArgumentError, match=empty):
        next(iter(buffer.as_dataset(sample_batch_size=2)))
    assert time.monotonic() - start < 10


def test_stop_sampling_fails_a_waiting_dataset(address: str) -> None:
    buffer = _buffer(address, "empty", sample_timeout=None)
    iterator = iter(buffer.as_dataset(sample_batch_size=2))
    buffer.stop_sampling()
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError):
        next(iterator)
    assert time.monotonic() - start < 10


def test_a_batch_too_large_is_refused_before_the_pipeline_is_built(address: str) -> None:
    buffer = _buffer(address, "nested")
    with pytest.raises(ConfigError, match=r"sample_batch_size.*'nested'"):
        buffer.as_dataset(sample_batch_size=10**12)
    assert buffer._data_spec is TF_SPEC
