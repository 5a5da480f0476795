"""The local backend's sampling streams built on a `LocalTable` directly: `LocalSampleSource`
checks its manager's lifeline and batch sizes, hands workers the shared table only once it is
shared, draws several batches per call only from tables of independent draws; `tf_dataset`
and `LocalReplayBuffer` give `[batch, sequence_length]` batches with the info broadcast, and
refuse what only Reverb has."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from replay_service.backends.base import Lifeline
from replay_service.backends.local import sampling
from replay_service.backends.local.sampling import (
    LocalReplayBuffer,
    LocalSampleSource,
    SampleInfo,
    WorkerSampleSource,
    tf_dataset,
)
from replay_service.backends.local.table import LocalTable
from replay_service.config.batch_limits import MAX_BATCH_SIZE
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import BufferStateError, ConfigError, ManagerClosedError
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.nests import describe_spec

STORED = {"x": ArraySpec((2,), np.float32), "n": ArraySpec((), np.int64)}
LENGTH = 3


def make(
    sampler: str = "uniform", **sampling_options: object
) -> tuple[LocalSampleSource, LocalTable]:
    sampling_config = SamplingConfig(sampler=sampler, **sampling_options)
    config = TableConfig("t", 8, LENGTH, sampling=sampling_config)
    table = LocalTable(config, describe_spec(STORED), seed=0)
    return LocalSampleSource(table, STORED, 0.05, Lifeline()), table


def fill(table: LocalTable, starts: list[int]) -> None:
    n = np.array([[s + i for i in range(LENGTH)] for s in starts], np.int64)
    table.insert([n, np.stack([n, -n], -1).astype(np.float32)], np.ones(len(starts)))


@pytest.mark.local
def test_a_source_samples_its_table_and_fails_once_its_manager_closes() -> None:
    source, table = make()
    assert source.item_bytes == table.item_bytes == LENGTH * (8 + 8)
    with pytest.raises(BufferStateError):
        source.sample(2)
    fill(table, [0, 10])
    data, info = source.sample(5)
    assert [tuple(t.shape) for t in data] == [(5, LENGTH), (5, LENGTH, 2)]
    assert set(data[0][:, 0].tolist()) <= {0, 10}
    assert set(info) == set(SampleInfo._fields)
    assert source.sample(2, with_info=False)[1] == {}
    source.lifeline.close()
    for call in (lambda: source.sample(1), source.prepare_workers):
        with pytest.raises(ManagerClosedError, match="the buffer of table 't' was closed"):
            call()


@pytest.mark.local
@pytest.mark.parametrize("size", [0, MAX_BATCH_SIZE + 1, 2.5])
def test_a_batch_size_out_of_range_is_refused_naming_the_value(size) -> None:
    source, table = make()
    fill(table, [0])
    with pytest.raises(ConfigError, match=rf"^batch_size\S* .*{size!r}"):
        source.sample(size)


@pytest.mark.local
def test_clears_count_the_tables_resets() -> None:
    source, table = make()
    fill(table, [0])
    assert source.clears() == 0
    table.reset()
    table.reset()
    assert source.clears() == 2


@pytest.mark.local
def test_workers_get_the_shared_table_only_after_prepare_workers() -> None:
    source, table = make()
    fill(table, [0, 10])
    with pytest.raises(ConfigError, match=r"table 't' lives in this process .*prepare_workers"):
        source.worker_source()
    with pytest.raises(ConfigError, match="prepare_workers"):
        pickle.dumps(source)
    source.prepare_workers()
    worker = source.worker_source()
    assert isinstance(worker, WorkerSampleSource)
    assert (worker.table_name, worker.sequence_length, worker.sample_timeout) == ("t", LENGTH, 0.05)
    # A spawned worker receives the worker's source, which reads the same shared memory.
    sent = pickle.loads(pickle.dumps(source))
    assert isinstance(sent, WorkerSampleSource) and sent.signature == STORED
    data, _ = sent.shared.reader(0).sample(4, timeout=1.0)
    assert set(data[0][:, 0].tolist()) <= {0, 10}


@pytest.mark.local
def test_workers_refuse_tables_whose_sampling_changes_them() -> None:
    source, _ = make("prioritized")
    with pytest.raises(ConfigError, match="'t'"):
        source.prepare_workers()


@pytest.mark.local
@pytest.mark.parametrize(
    ("sampler", "options", "batch", "draws"),
    [
        ("uniform", {}, 8, sampling.DRAW_BATCHES),
        ("uniform", {}, sampling.DRAW_ITEMS // 2, 2),
        ("uniform", {}, sampling.DRAW_ITEMS, 1),
        ("uniform", {"max_times_sampled": 2}, 8, 1),
        ("prioritized", {}, 8, 1),
        ("fifo", {}, 8, 1),
    ],
)
def test_only_independent_draws_are_drawn_several_batches_at_a_time(
    sampler, options, batch, draws
) -> None:
    source, _ = make(sampler, **options)
    assert source.draws_per_call(batch) == draws
    assert source.ordered == (sampler == "fifo")


@pytest.mark.local
def test_the_replay_buffer_refuses_what_only_reverb_has_and_clears_and_stops() -> None:
    source, table = make()
    resets: list[int] = []
    buffer = LocalReplayBuffer(source, lambda: resets.append(1))
    assert buffer.data_spec == STORED and buffer.lifeline is source.lifeline
    fill(table, [0, 10, 20])
    assert buffer.num_frames() == 3
    with pytest.raises(
        ConfigError,
        match=r"needs sample_batch_size and num_steps None or 3 "
        r"\(got None, None\)",
    ):
        buffer.as_dataset()
    with pytest.raises(ConfigError, match=r"\(got 4, 2\)"):
        buffer.as_dataset(4, num_steps=2)
    with pytest.raises(ConfigError, match="single_deterministic_pass need backend='reverb'"):
        buffer.as_dataset(4, single_deterministic_pass=True)
    with pytest.raises(ConfigError, match="sequence_preprocess_fn"):
        buffer.as_dataset(4, sequence_preprocess_fn=lambda x: x)
    with pytest.raises(ConfigError, match="sample_batch_size must be a positive integer, got 0"):
        buffer.as_dataset(0)
    buffer.clear()
    assert resets == [1]
    buffer.stop_sampling()
    with pytest.raises(ManagerClosedError):
        source.sample(1)


@pytest.mark.heavy
def test_tf_datasets_give_whole_items_with_their_info_along_the_sequence() -> None:
    import tensorflow as tf

    source, table = make()
    fill(table, [0, 10, 20])
    for dataset in (
        tf_dataset(source, 4, prefetch=2),
        LocalReplayBuffer(source, list).as_dataset(4),
    ):
        data, info = next(iter(dataset))
        n, x = data["n"].numpy(), data["x"].numpy()
        assert n.shape == (4, LENGTH) and x.shape == (4, LENGTH, 2)
        np.testing.assert_array_equal(n - n[:, :1], np.tile(np.arange(LENGTH), (4, 1)))
        assert set(n[:, 0].tolist()) <= {0, 10, 20}
        np.testing.assert_array_equal(x[..., 0], n)
        assert isinstance(info, SampleInfo)
        assert info.key.dtype == tf.uint64 and info.times_sampled.dtype == tf.int32
        for field in info:
            assert field.shape == (4, LENGTH)
            np.testing.assert_array_equal(field.numpy(), field.numpy()[:, :1].repeat(LENGTH, 1))
        np.testing.assert_array_equal(info.table_size.numpy(), np.full((4, LENGTH), 3))
        keys = set(info.key.numpy()[:, 0].tolist())
        assert len(keys) <= 3 and all(k > 0 for k in keys)
    source.lifeline.close()
    with pytest.raises(tf.errors.OpError, match="the buffer of table 't' was closed"):
        next(iter(tf_dataset(source, 2)))
