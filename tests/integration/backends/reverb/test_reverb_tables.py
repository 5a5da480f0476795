"""`backends.reverb.tables`: the Reverb tables built from `TableConfig`s, as a running server
reports them (sampler, remover, limiter, signature), and which of them draw independently."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import reverb
import tensorflow as tf

from replay_service.backends.reverb.tables import (
    draws_independently,
    make_replay_tables,
    make_variable_table,
)
from replay_service.config.options import SamplingConfig, TableConfig, VariableTableConfig
from replay_service.specs.arrays import ArraySpec, trajectory_spec

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
CONFIGS = (
    TableConfig(name="uniform", capacity=10, sequence_length=3, layout="nested"),
    TableConfig(
        name="prioritized",
        capacity=20,
        sequence_length=2,
        layout="nested",
        sampling=SamplingConfig(sampler="prioritized", priority_exponent=0.8, remover="lifo"),
    ),
    TableConfig(
        name="ratio",
        capacity=10,
        sequence_length=2,
        layout="nested",
        sampling=SamplingConfig(samples_per_insert=4.0, min_size_to_sample=3, error_buffer=5.0),
    ),
    TableConfig(
        name="once",
        capacity=10,
        sequence_length=2,
        layout="nested",
        sampling=SamplingConfig(max_times_sampled=1),
    ),
    TableConfig(
        name="fifo",
        capacity=10,
        sequence_length=2,
        layout="nested",
        sampling=SamplingConfig(sampler="fifo", remover="max_heap"),
    ),
)


@pytest.fixture(scope="module")
def info() -> Iterator[dict]:
    variables = VariableTableConfig(spec={"w": tf.TensorSpec([3], tf.float32)})
    tables = [*make_replay_tables(CONFIGS, SPEC), make_variable_table(variables)]
    server = reverb.Server(tables, port=None)
    yield server.localhost_client().server_info(timeout=10)
    server.stop()


def test_samplers_removers_and_sizes_are_those_configured(info: dict) -> None:
    assert info["uniform"].max_size == 10 and info["prioritized"].max_size == 20
    assert info["uniform"].sampler_options.WhichOneof("distribution") == "uniform"
    assert info["prioritized"].sampler_options.prioritized.priority_exponent == pytest.approx(0.8)
    assert info["prioritized"].remover_options.WhichOneof("distribution") == "lifo"
    assert info["fifo"].sampler_options.WhichOneof("distribution") == "fifo"
    assert info["fifo"].remover_options.WhichOneof("distribution") == "heap"
    assert info["once"].max_times_sampled == 1


def test_rate_limiters_follow_samples_per_insert(info: dict) -> None:
    plain = info["uniform"].rate_limiter_info
    assert plain.min_size_to_sample == 1 and plain.samples_per_insert == 1.0
    ratio = info["ratio"].rate_limiter_info
    assert ratio.samples_per_insert == 4.0 and ratio.min_size_to_sample == 3
    # SampleToInsertRatio centres the error buffer on min_size_to_sample * samples_per_insert.
    assert (ratio.min_diff, ratio.max_diff) == (12.0 - 5.0, 12.0 + 5.0)


def test_signatures_add_the_sequence_length(info: dict) -> None:
    signature = info["uniform"].signature
    assert signature.observation == tf.TensorSpec([3, 2], tf.float32, "observation")
    assert signature.action.shape == [3]
    assert info["prioritized"].signature.observation.shape == [2, 2]


def test_only_uniform_unlimited_minsize_tables_draw_independently(info: dict) -> None:
    found = {name: draws_independently(i) for name, i in info.items()}
    assert found == {
        "uniform": True,
        "prioritized": False,
        "ratio": False,
        "once": False,
        "fifo": False,
        "variables": True,
    }


def test_the_variable_table_holds_one_item_sampled_forever(info: dict) -> None:
    variables = info["variables"]
    assert variables.max_size == 1 and variables.max_times_sampled == 0
    assert variables.remover_options.WhichOneof("distribution") == "fifo"
    assert variables.signature == {"w": tf.TensorSpec([3], tf.float32)}


def test_duplicate_table_names_are_refused_by_name() -> None:
    twice = [CONFIGS[0], CONFIGS[1], CONFIGS[0]]
    with pytest.raises(ValueError, match=r"duplicates \['uniform'\]"):
        make_replay_tables(twice, SPEC)
