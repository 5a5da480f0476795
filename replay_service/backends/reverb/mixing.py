"""Mixing tables in tf.data: batches whose items each come from a table drawn by weight.

`mixed_dataset` samples every table through its own sampler and picks the table of each item
independently, bounded by `sampling_errors.bound_sampling` like every sampling path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.layout_datasets import unpack_samples
from replay_service.backends.reverb.pipeline import item_dataset, splitter
from replay_service.backends.reverb.sampling_errors import EMPTY_BUFFER_MESSAGE, bound_sampling
from replay_service.config.options import TableConfig, require_positive_int
from replay_service.config.tables import check_mix_weights, find_table
from replay_service.errors import ConfigError
from replay_service.specs.layouts import Layout


def mixed_dataset(
    server_address: str,
    tables: Sequence[TableConfig],
    weights: Mapping[str, float],
    data_spec: Any,
    batch_size: int,
    *,
    sample_timeout: float | None,
    seed: int | None = None,
    connect_timeout: float | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
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
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The tables' layout (a packed table's rows are unpacked once per batch).

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`
      that raises instead of ending or blocking (see `bound_sampling`).

    Raises:
      ConfigError: If the weights are invalid (see `check_mix_weights`) or `batch_size` < 1.
    """
    require_positive_int("batch_size", batch_size, maximum=None)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    probabilities = check_mix_weights(tables, weights)
    sequence_length = find_table(tables, next(iter(probabilities))).sequence_length
    signature = layout.item_signature(sequence_length)
    datasets = []
    for name, probability in probabilities.items():
        config = find_table(tables, name)
        ordered = config.sampling.sampler in ("fifo", "lifo", "max_heap", "min_heap")
        datasets.append(
            item_dataset(
                server_address,
                name,
                signature,
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
    batches = unpack_samples(layout, items.batch(batch_size, drop_remainder=True))
    return bound_sampling(
        batches,
        server_address,
        list(probabilities),
        f"{EMPTY_BUFFER_MESSAGE} from one of the mixed tables {list(probabilities)} within "
        f"{sample_timeout} s: a table is empty (or holds fewer items than min_size_to_sample), "
        "or its samples-per-insert rate limiter waits for more inserts. Collect data first, or "
        "raise Timeouts.sample.",
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
    ).map(splitter(sequence_length))
