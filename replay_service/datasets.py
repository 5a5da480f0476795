"""tf.data sampling with a bounded wait.

Reverb datasets built with `rate_limiter_timeout_ms` simply end when no item arrives in time,
which a training loop sees as a silently exhausted dataset. `raise_when_exhausted` turns that end
into an error that says why.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import reverb
import tensorflow as tf
from tf_agents.replay_buffers import reverb_replay_buffer

from replay_service.config import TableConfig, to_ms
from replay_service.errors import ConfigError
from replay_service.specs import table_signature
from replay_service.tables import find_table

EMPTY_BUFFER_MESSAGE = "replay_service: no item could be sampled"


def raise_when_exhausted(dataset: tf.data.Dataset, message: str) -> tf.data.Dataset:
    """Makes `dataset` raise `tf.errors.InvalidArgumentError(message)` instead of ending.

    Args:
      dataset: A dataset that ends only when sampling timed out.
      message: The error message.

    Returns:
      A dataset with the same elements and element spec.
    """
    spec = dataset.element_spec

    def fail(_: tf.Tensor) -> Any:
        check = tf.debugging.Assert(tf.constant(False), [tf.constant(message)], name="sampling")
        with tf.control_dependencies([check]):
            return tf.nest.map_structure(
                lambda s: tf.zeros([d if d is not None else 0 for d in s.shape], s.dtype), spec
            )

    return dataset.concatenate(tf.data.Dataset.range(1).map(fail))


def sampling_timeout_message(table_name: str, timeout_s: float) -> str:
    """The error text of a sampling timeout on `table_name`."""
    return (
        f"{EMPTY_BUFFER_MESSAGE} from table {table_name!r} within {timeout_s} s: the buffer is "
        "empty (or holds fewer items than min_size_to_sample), or its samples-per-insert rate "
        "limiter waits for more inserts. Collect data first, or raise Timeouts.sample."
    )


def sample_dataset(
    server_address: str,
    table_name: str,
    data_spec: Any,
    sequence_length: int,
    batch_size: int,
    *,
    sample_timeout: float | None,
    num_workers: int = 2,
    max_in_flight: int | None = None,
) -> tf.data.Dataset:
    """A tuned sampling pipeline with the element structure of TF-Agents' `as_dataset`.

    One `reverb.TrajectoryDataset` with a deep in-flight window and a few workers, batched,
    replaces TF-Agents' interleave of up to 32 shallow datasets: the same `(trajectory,
    sample_info)` batches (info broadcast to `[batch, sequence_length]`) at a fraction of the
    per-batch overhead.

    Args:
      server_address: "host:port" of the server.
      table_name: Table to sample.
      data_spec: Per-step data spec.
      sequence_length: Steps per item.
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item before raising; None waits forever.
      num_workers: Sampling workers (1 keeps the order of FIFO/LIFO/heap samplers).
      max_in_flight: Samples requested ahead per worker; default `4 * batch_size` (>= 64).

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`.
    """
    dataset = _item_dataset(
        server_address,
        table_name,
        data_spec,
        sequence_length,
        sample_timeout=sample_timeout,
        num_workers=num_workers,
        max_in_flight=max_in_flight or max(64, 4 * batch_size),
    ).batch(batch_size, drop_remainder=True)
    dataset = dataset.map(_splitter(sequence_length))
    if sample_timeout is None:
        return dataset
    return raise_when_exhausted(dataset, sampling_timeout_message(table_name, sample_timeout))


def check_mix_weights(
    tables: Sequence[TableConfig], weights: Mapping[str, float]
) -> dict[str, float]:
    """Validates the weights of a mix of tables and returns them normalized to sum to 1.

    Args:
      tables: Every table of the buffer.
      weights: Table name -> weight; each finite and >= 0, with a positive sum.

    Returns:
      Table name -> probability, in the order of `weights`, tables of weight 0 left out.

    Raises:
      ConfigError: If `weights` is empty or not a mapping, names an unknown table, holds a
        weight that is not a finite number >= 0, sums to 0, or mixes tables whose
        sequence lengths differ.
    """
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(
            f"weights must be a non-empty mapping table name -> weight, got {weights!r}"
        )
    lengths = {}
    for name, weight in weights.items():
        lengths[name] = find_table(tables, name).sequence_length
        if (
            not isinstance(weight, numbers.Real)
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise ConfigError(
                f"weight of table {name!r} must be a finite number >= 0, got {weight!r}"
            )
    total = float(sum(weights.values()))
    if total <= 0:
        raise ConfigError(f"weights must have a positive sum, got {dict(weights)!r}")
    if len(set(lengths.values())) > 1:
        raise ConfigError(
            "a mix needs tables of one sequence_length (items are batched together), got "
            f"{lengths!r}"
        )
    return {name: float(w) / total for name, w in weights.items() if w > 0}


def mixed_dataset(
    server_address: str,
    tables: Sequence[TableConfig],
    weights: Mapping[str, float],
    data_spec: Any,
    batch_size: int,
    *,
    sample_timeout: float | None,
    seed: int | None = None,
) -> tf.data.Dataset:
    """Batches whose items each come from table `name` with probability weight / sum(weights).

    Each table is sampled by its own sampler (uniform, prioritized...) through an unbatched
    `reverb.TrajectoryDataset`; `tf.data.Dataset.sample_from_datasets` picks the table of every
    item independently. `sample_info` is that of the table the item came from: its `key` is
    unique across the tables of one server (the same window written into two tables gets two
    keys), so `update_priorities(info.key, p, table=name)` with every key of a mixed batch
    updates exactly the items of `name`; `probability` and `table_size` are per table.

    Args:
      server_address: "host:port" of the server.
      tables: Every table of the buffer.
      weights: Table name -> weight (see `check_mix_weights`).
      data_spec: Per-step data spec.
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item of a table before raising; None waits forever.
      seed: Seed of the choice of tables; None draws a random one.

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`.

    Raises:
      ConfigError: If the weights are invalid (see `check_mix_weights`) or `batch_size` < 1.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    probabilities = check_mix_weights(tables, weights)
    sequence_length = find_table(tables, next(iter(probabilities))).sequence_length
    datasets = []
    for name, probability in probabilities.items():
        config = find_table(tables, name)
        ordered = config.sampling.sampler in ("fifo", "lifo", "max_heap", "min_heap")
        datasets.append(
            _item_dataset(
                server_address,
                name,
                data_spec,
                sequence_length,
                sample_timeout=sample_timeout,
                num_workers=1 if ordered else 2,
                # About four batches' worth of this table's items ahead, like sample_dataset.
                max_in_flight=max(16, math.ceil(4 * batch_size * probability)),
            )
        )
    if len(datasets) == 1:
        items = datasets[0]
    else:
        # An exhausted table (sampling timed out) ends the mix instead of silently
        # changing its proportions.
        items = tf.data.Dataset.sample_from_datasets(
            datasets,
            weights=list(probabilities.values()),
            seed=seed,
            stop_on_empty_dataset=True,
        )
    dataset = items.batch(batch_size, drop_remainder=True).map(_splitter(sequence_length))
    if sample_timeout is None:
        return dataset
    return raise_when_exhausted(
        dataset,
        f"{EMPTY_BUFFER_MESSAGE} from one of the mixed tables {list(probabilities)} within "
        f"{sample_timeout} s: a table is empty (or holds fewer items than min_size_to_sample), "
        "or its samples-per-insert rate limiter waits for more inserts. Collect data first, or "
        "raise Timeouts.sample.",
    )


def _item_dataset(
    server_address: str,
    table_name: str,
    data_spec: Any,
    sequence_length: int,
    *,
    sample_timeout: float | None,
    num_workers: int,
    max_in_flight: int,
) -> tf.data.Dataset:
    """Unbatched `ReplaySample(info, data)` items of one table; ends when sampling times out."""
    signature = table_signature(data_spec, sequence_length)
    timeout_ms = to_ms(sample_timeout)
    return reverb.TrajectoryDataset(
        server_address,
        table_name,
        dtypes=tf.nest.map_structure(lambda s: s.dtype, signature),
        shapes=tf.nest.map_structure(lambda s: s.shape, signature),
        max_in_flight_samples_per_worker=max_in_flight,
        num_workers_per_iterator=num_workers,
        rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
    )


def _splitter(sequence_length: int) -> Any:
    """Maps a batch of `ReplaySample` to `(data, info)`, info broadcast to `[B, T]`."""

    def split(sample: reverb.ReplaySample) -> tuple[Any, Any]:
        info = tf.nest.map_structure(
            lambda x: tf.repeat(x[:, None], sequence_length, axis=1), sample.info
        )
        return sample.data, info

    return split


class ReplayBuffer(reverb_replay_buffer.ReverbReplayBuffer):
    """TF-Agents' `ReverbReplayBuffer` whose datasets fail clearly instead of waiting forever.

    Everything else (`as_dataset`, `num_frames`, `py_client`, `clear`...) is TF-Agents'.

    Args:
      data_spec: Per-step data spec.
      table_name: Table to sample.
      sequence_length: Steps per item.
      sample_timeout: Seconds to wait for an item before the dataset raises; None waits forever.
      **kwargs: Passed to `ReverbReplayBuffer` (`server_address` or `local_server`, ...).
    """

    def __init__(
        self,
        data_spec: Any,
        table_name: str,
        sequence_length: int,
        *,
        sample_timeout: float | None,
        **kwargs: Any,
    ) -> None:
        timeout_ms = to_ms(sample_timeout)
        super().__init__(
            data_spec,
            table_name,
            sequence_length,
            rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
            **kwargs,
        )
        self._sample_timeout = sample_timeout

    # Datasets built inside tf.data functions (the sharded mixture's flat_map) would otherwise
    # be converted by AutoGraph, whose rewrite of a zero-argument super() looks the class up by
    # walking every stack frame's locals; depending on what ran before in the process, that
    # lookup failed with a TypeError from the converted __init__.
    @tf.autograph.experimental.do_not_convert
    def _as_dataset(self, *args: Any, **kwargs: Any) -> tf.data.Dataset:
        dataset = super()._as_dataset(*args, **kwargs)
        if self._sample_timeout is None:
            return dataset
        return raise_when_exhausted(
            dataset, sampling_timeout_message(self._table_name, self._sample_timeout)
        )
