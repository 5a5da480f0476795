"""The tf.data read pipeline of one table: the batches every sampling stream is built from.

`read_pipeline` (`get_dataset`, `torch_batches`, `torch_dataset`) batches a table's items read
by a few `reverb.TrajectoryDataset`s with deep in-flight windows, bounded by
`sampling_errors.bound_sampling`; `sample_dataset` gives them the element structure of
TF-Agents' `as_dataset`, `(data, info)` with info broadcast over the steps (`splitter`).
"""

from __future__ import annotations

from typing import Any

import reverb
import tensorflow as tf

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.layout_datasets import unpack_samples
from replay_service.backends.reverb.sampling_errors import bound_sampling, sampling_timeout_message
from replay_service.config.options import to_ms
from replay_service.specs.layouts import Layout
from replay_service.specs.nests import table_signature


def default_in_flight(batch_size: int) -> int:
    """Samples requested ahead per Reverb worker: about four batches, at least 64."""
    return max(64, 4 * batch_size)


def read_pipeline(
    server_address: str,
    table_name: str,
    signature: Any,
    batch_size: int,
    *,
    sample_timeout: float | None,
    connect_timeout: float | None = None,
    num_workers: int = 2,
    max_in_flight: int | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
    unpack: bool = True,
) -> tf.data.Dataset:
    """Batches of `ReplaySample(info, data)` of one table, bounded by `bound_sampling`.

    `num_workers` `reverb.TrajectoryDataset`s of one worker each with a deep in-flight window,
    each batched on its own thread, their batches taken in the order they are ready.

    Args:
      server_address: "host:port" of the server.
      table_name: Table to sample.
      signature: Nest of `tf.TensorSpec` of one item (leading dimension `sequence_length`).
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item before raising; None waits forever.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      num_workers: Sample streams (1 keeps the order of FIFO/LIFO/heap samplers).
      max_in_flight: Samples requested ahead per stream; None: `default_in_flight`.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The table's layout; a packed table's rows are read and unpacked into
        `signature`'s nest once per batch (`layout_datasets.unpack_samples`).
      unpack: Whether a packed table's rows are unpacked; False: `data` is the batch of
        packed rows, `uint8[batch_size, sequence_length, step_bytes]` (for readers that
        unpack them outside TensorFlow, see `Layout.batch_reader`).

    Returns:
      An endless dataset of batches with leading dim `batch_size`. Iterating raises
      `tf.errors.InvalidArgumentError` when no item arrives within `sample_timeout`
      (`EMPTY_BUFFER_MESSAGE`), when the server has been unreachable for `sample_timeout`
      (`SERVER_LOST_MESSAGE`, within `liveness_bound(sample_timeout, connect_timeout)` s) and
      when `lifeline` was closed (`MANAGER_CLOSED_MESSAGE`).
    """
    item_signature = layout.item_signature(_length(signature))
    in_flight = max_in_flight or default_in_flight(batch_size)

    def stream(_: Any = None) -> tf.data.Dataset:
        return item_dataset(
            server_address,
            table_name,
            item_signature,
            sample_timeout=sample_timeout,
            num_workers=1,
            max_in_flight=in_flight,
        ).batch(batch_size, drop_remainder=True)

    if num_workers == 1:
        batches = stream()
    else:
        # One sample stream per worker, each batching its own items on its own tf.data thread:
        # Reverb unpacks items and tf.data copies them into batches in the thread that pulls
        # them, so one stream with several workers kept that work on one thread.
        batches = tf.data.Dataset.range(num_workers).interleave(
            tf.autograph.experimental.do_not_convert(stream),
            cycle_length=num_workers,
            block_length=1,
            num_parallel_calls=num_workers,
            deterministic=False,
        )
    if unpack:
        batches = unpack_samples(layout, batches)
    return bound_sampling(
        batches,
        server_address,
        table_name,
        sampling_timeout_message(table_name, sample_timeout),
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
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
    connect_timeout: float | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
) -> tf.data.Dataset:
    """A tuned sampling pipeline with the element structure of TF-Agents' `as_dataset`.

    `read_pipeline` (one `reverb.TrajectoryDataset` with a deep in-flight window and a few
    workers, batched) replaces TF-Agents' interleave of up to 32 shallow datasets: the same
    `(trajectory, sample_info)` batches (info broadcast to `[batch, sequence_length]`) at a
    fraction of the per-batch overhead.

    Args:
      server_address: "host:port" of the server.
      table_name: Table to sample.
      data_spec: Per-step data spec.
      sequence_length: Steps per item.
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item before raising; None waits forever.
      num_workers: Sample streams (1 keeps the order of FIFO/LIFO/heap samplers).
      max_in_flight: Samples requested ahead per worker; default `4 * batch_size` (>= 64).
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The table's layout.

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`
      that raises instead of ending or blocking (see `read_pipeline`).
    """
    return read_pipeline(
        server_address,
        table_name,
        table_signature(data_spec, sequence_length),
        batch_size,
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        num_workers=num_workers,
        max_in_flight=max_in_flight,
        lifeline=lifeline,
        layout=layout,
    ).map(splitter(sequence_length))


def item_dataset(
    server_address: str,
    table_name: str,
    signature: Any,
    *,
    sample_timeout: float | None,
    num_workers: int,
    max_in_flight: int,
) -> tf.data.Dataset:
    """Unbatched `ReplaySample(info, data)` items of one table; ends when sampling times out."""
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


def _length(signature: Any) -> int:
    """The leading (time) dimension of an item signature."""
    return int(tf.nest.flatten(signature)[0].shape[0])


def splitter(sequence_length: int) -> Any:
    """Maps a batch of `ReplaySample` to `(data, info)`, info broadcast to `[B, T]`."""

    def split(sample: reverb.ReplaySample) -> tuple[Any, Any]:
        info = tf.nest.map_structure(
            lambda x: tf.repeat(x[:, None], sequence_length, axis=1), sample.info
        )
        return sample.data, info

    return split
