"""What a sampling dataset raises instead of ending or blocking, and the messages it raises.

An empty table (or a rate limiter waiting for inserts): Reverb datasets built with
`rate_limiter_timeout_ms` simply end when no item arrives in time, which a training loop sees as
a silently exhausted dataset; `raise_when_exhausted` turns that end into an error that says why.
`bound_sampling` applies it and the server's liveness guard (`liveness.guard_liveness`), and
every sampling path goes through it: `pipeline.read_pipeline` (`get_dataset`, `torch_batches`,
`torch_dataset`), `mixing.mixed_dataset`, and `tf_agents_buffer.ReplayBuffer.as_dataset`
(TF-Agents' pipeline; the sharded datasets are built from it). `replay_service_message` reads
the message of such an error back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.liveness import guard_liveness

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


def sampling_timeout_message(table_name: str, timeout_s: float | None) -> str:
    """The error text of a sampling timeout on `table_name`."""
    return (
        f"{EMPTY_BUFFER_MESSAGE} from table {table_name!r} within {timeout_s} s: the buffer is "
        "empty (or holds fewer items than min_size_to_sample), or its samples-per-insert rate "
        "limiter waits for more inserts. Collect data first, or raise Timeouts.sample."
    )


# Reverb's sampler error for an item whose columns are not the table signature's.
FOREIGN_ITEM_ERROR = "Inconsistent number of tensors received"


def foreign_item_message(table_name: str, reverb_message: str) -> str:
    """The error text of sampling an item that does not match `table_name`'s signature.

    Args:
      table_name: The sampled table.
      reverb_message: Reverb's own message (kept at the end).

    Returns:
      What happened, the usual cause and what to do.
    """
    return (
        f"table {table_name!r} holds an item whose columns are not its signature's: it was "
        "written by a writer that does not check items against the table signature, such as "
        "TF-Agents' ReverbAddTrajectoryObserver (validate_items=False) on a layout='packed' "
        "table (whose steps are one uint8 column). Write through the manager's observer() or "
        "writers; export() skips such items with a warning, so the others can be imported into "
        f"a new buffer. Reverb: {reverb_message}"
    )


def replay_service_message(error: tf.errors.OpError) -> str | None:
    """The message of a sampling error raised by one of our guards, without TF's decoration.

    Args:
      error: An error raised while iterating a dataset.

    Returns:
      The text from "replay_service:" to the end of the assertion, or None if `error` was not
      raised by `raise_when_exhausted` or `guard_liveness`.
    """
    start = error.message.find("replay_service:")
    if start < 0:
        return None
    end = error.message.find("]", start)
    text = error.message[start : end if end >= 0 else None]
    return text.replace("\\'", "'").replace('\\"', '"')


def bound_sampling(
    dataset: tf.data.Dataset,
    server_address: str,
    table_name: str | Sequence[str],
    exhausted_message: str,
    *,
    sample_timeout: float | None,
    connect_timeout: float | None,
    lifeline: Lifeline | None,
) -> tf.data.Dataset:
    """The in-flight rules of every sampling dataset: errors instead of an end or a hang.

    Args:
      dataset: Endless batches (or items) sampled from `server_address`, which end only when
        sampling timed out (`rate_limiter_timeout_ms`).
      server_address: "host:port" of the server.
      table_name: The table sampled (or the tables mixed), for messages.
      exhausted_message: The error text when no item arrives within `sample_timeout`.
      sample_timeout: `Timeouts.sample`; None waits for items forever (the server is still
        watched, see `LivenessRules`).
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out; None: never closed.

    Returns:
      A dataset with the same elements that raises `tf.errors.InvalidArgumentError` with
      `exhausted_message`, or naming the lost server, instead of ending or blocking.
    """
    if sample_timeout is not None:
        dataset = raise_when_exhausted(dataset, exhausted_message)
    return guard_liveness(
        dataset,
        server_address,
        table_name,
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
    )
