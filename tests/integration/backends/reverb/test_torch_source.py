"""`SampleSource` on a real Reverb server, without a manager: it describes a table from its
handle (independent draws as the server's table samples), pickles without a connection, reads
nested and packed tables into the same torch batches, turns the pipeline's failures into our
errors, and stops once its lifeline is closed; `tensor_to_torch` shares the tensor's memory."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator
from contextlib import closing

import numpy as np
import pytest
import reverb
import tensorflow as tf
import torch

from conftest import FAST_TIMEOUTS
from replay_service.backends.base import Lifeline
from replay_service.backends.reverb import torch_source
from replay_service.backends.reverb.bounded_client import BoundedClient
from replay_service.backends.reverb.handles import TableHandle
from replay_service.backends.reverb.tables import make_table
from replay_service.backends.reverb.torch_source import SampleSource, tensor_to_torch
from replay_service.backends.reverb.transfer import insert_items
from replay_service.config.options import SamplingConfig, TableConfig, Timeouts
from replay_service.errors import BufferStateError, ManagerClosedError, ServerUnavailableError
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.layouts import NestedLayout
from replay_service.specs.packed import PackedLayout
from replay_service.storage.export import ExportedItems

pytestmark = pytest.mark.heavy  # tf.data pipelines

SPEC = {"obs": ArraySpec((2,), np.float32), "action": ArraySpec((), np.int64)}
LENGTH = 2
TIMEOUTS = Timeouts(connect=5.0, write=10.0, sample=0.5, checkpoint=60.0)
TABLES = {
    "nested": TableConfig("nested", 50, LENGTH, layout="nested"),
    "packed": TableConfig("packed", 50, LENGTH, layout="packed"),
    "fifo": TableConfig("fifo", 50, LENGTH, sampling=SamplingConfig(sampler="fifo")),
    "empty": TableConfig("empty", 50, LENGTH, layout="nested"),
}
STARTS = [0, 10, 20]


@pytest.fixture(scope="module")
def server() -> Iterator[reverb.Server]:
    server = reverb.Server([make_table(t, SPEC) for t in TABLES.values()], port=None)
    client = BoundedClient(reverb.Client(f"localhost:{server.port}"), FAST_TIMEOUTS)
    action = np.array([[s, s + 1] for s in STARTS], np.int64)
    items = ExportedItems(
        data=[action, np.stack([action, -action], -1).astype(np.float32)],
        priorities=np.ones(len(STARTS)),
        times_sampled=np.zeros(len(STARTS), np.int32),
    )
    for name in ("nested", "packed", "fifo"):
        layout = resolve_layout(TABLES[name].layout, SPEC)
        insert_items(client, name, LENGTH, items, FAST_TIMEOUTS, layout)
    yield server
    server.stop()


def handle(server: reverb.Server, name: str) -> TableHandle:
    table = TABLES[name]
    return TableHandle(
        f"localhost:{server.port}", table, SPEC, TIMEOUTS, resolve_layout(table.layout, SPEC)
    )


def check_batch(batch: dict[str, torch.Tensor], size: int) -> None:
    action, obs = batch["action"], batch["obs"]
    assert action.shape == (size, LENGTH) and action.dtype == torch.int64
    assert obs.shape == (size, LENGTH, 2) and obs.dtype == torch.float32
    assert set(action[:, 0].tolist()) <= set(STARTS)
    torch.testing.assert_close(action[:, 1], action[:, 0] + 1)
    torch.testing.assert_close(obs[..., 0], action.float())
    torch.testing.assert_close(obs[..., 1], -action.float())


def test_a_source_describes_its_table_and_pickles_without_a_connection(server) -> None:
    source = SampleSource.from_handle(handle(server, "nested"), lifeline=Lifeline())
    assert (source.table_name, source.sequence_length, source.sample_timeout) == ("nested", 2, 0.5)
    assert source.connect_timeout == 5.0 and not source.ordered
    assert source.independent  # a uniform table, as the server's samples
    assert isinstance(source.table_layout, NestedLayout)
    copy = pickle.loads(pickle.dumps(source))
    assert dataclasses.replace(copy, layout=source.layout) == source
    assert isinstance(copy.table_layout, NestedLayout)
    fifo = SampleSource.from_handle(handle(server, "fifo"))
    assert fifo.ordered and not fifo.independent
    # A layout named on construction is resolved for the signature's steps.
    named = SampleSource(
        source.server_address, "packed", source.signature, LENGTH, 0.5, layout="packed"
    )
    assert isinstance(named.table_layout, PackedLayout)
    assert named.table_layout.step_bytes == 16


def test_a_server_that_does_not_answer_is_no_independent_sampler(server) -> None:
    table = handle(server, "nested")
    gone = TableHandle("localhost:1", table.table, SPEC, Timeouts(connect=0.2), table.layout)
    assert not SampleSource.from_handle(gone).independent


@pytest.mark.parametrize("name", ["nested", "packed"])
@pytest.mark.parametrize("numpy_unpack", [True, False])
def test_nested_and_packed_tables_give_the_same_torch_batches(
    server, monkeypatch, name, numpy_unpack
) -> None:
    if not numpy_unpack:  # packed rows unpacked by TensorFlow in the pipeline
        monkeypatch.setattr(torch_source, "NUMPY_UNPACK_STEP_BYTES", 0)
    source = SampleSource.from_handle(handle(server, name))
    stream = source.torch_samples(4, convert=lambda t: t.clone())
    for _ in range(3):
        batch, info = next(stream)
        check_batch(batch, 4)
        key, probability, table_size, priority, _ = info
        assert key.dtype == torch.uint64 and key.shape == (4,)
        assert torch.all(table_size == 3) and torch.all(priority == 1.0)
        torch.testing.assert_close(probability, torch.full((4,), 1 / 3, dtype=torch.float64))
    stream.close()
    with closing(source.torch_samples(2, with_info=False, num_workers=1)) as stream:
        batch, info = next(stream)
    check_batch(batch, 2)
    assert info is None


def test_an_empty_table_fails_within_the_sample_timeout_naming_it(server) -> None:
    with closing(SampleSource.from_handle(handle(server, "empty")).torch_samples(2)) as stream:
        with pytest.raises(BufferStateError, match=r"'empty'.*0\.5"):
            next(stream)


def test_a_closed_lifeline_stops_the_stream_and_clears_are_counted(server) -> None:
    lifeline = Lifeline()
    source = SampleSource.from_handle(handle(server, "nested"), lifeline=lifeline)
    assert source.closed_error() is None and source.clears() == 0
    stream = source.torch_samples(2)
    check_batch(next(stream)[0], 2)
    lifeline.cleared()
    assert source.clears() == 1
    check_batch(next(stream)[0], 2)  # a new pipeline after the clear
    lifeline.close()
    with pytest.raises(ManagerClosedError, match=rf"server {source.server_address}, table nested"):
        next(stream)
    stream.close()


@pytest.mark.parametrize("dtype", [tf.float32, tf.int64, tf.bool, tf.uint8])
def test_tensor_to_torch_shares_the_tensors_memory(dtype) -> None:
    value = tf.cast(tf.reshape(tf.range(6), (2, 3)) % 2, dtype)
    tensor = tensor_to_torch(value)
    assert tensor.shape == (2, 3)
    np.testing.assert_array_equal(tensor.numpy(), value.numpy())
    assert tensor.dtype == torch.from_numpy(value.numpy()).dtype
    assert tensor_to_torch(value).data_ptr() == tensor.data_ptr()  # the tensor's own buffer


def test_errors_that_are_not_the_pipelines_bounds_are_left_to_tensorflow() -> None:
    def error(message: str) -> tf.errors.InvalidArgumentError:
        return tf.errors.InvalidArgumentError(None, None, message)

    assert torch_source._sampling_error(error("shapes differ")) is None
    assert torch_source._sampling_error(error("replay_service: something else]")) is None
    lost = torch_source._sampling_error(error("x [replay_service: lost the Reverb server at a]"))
    assert isinstance(lost, ServerUnavailableError) and str(lost).endswith("server at a")
    empty = torch_source._sampling_error(error("replay_service: no item could be sampled"))
    assert isinstance(empty, BufferStateError)
