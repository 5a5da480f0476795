"""Reverb's side of an export and an import: every item of a table read once, and written back.

The items of an export, and of an epoch pass, are read exactly once (`read_items`); an import
writes them back in order (`insert_items`); the files are `storage.export`'s. Reverb has no
"iterate all items" call, and sampling the live table would count toward its rate limiter,
`times_sampled` and `max_times_sampled`. The export therefore takes a checkpoint with the
manager and reads that: the item records (`items.tfrecord`) give keys, priorities,
`times_sampled` and the insertion order; the data is decoded by Reverb itself, in a throw-away
in-process server restored from a copy of the checkpoint whose table was rewritten to a FIFO
sampler with `max_times_sampled=1` and no rate limit. Sampling that copy returns each item
exactly once, oldest first, then leaves it empty; the items are placed by key into the order of
the item records. The live table is not touched beyond the checkpoint, which becomes the newest
checkpoint of `checkpoint_dir`. The copy holds the buffer in memory a second time while the
export runs, and like every Reverb server it listens on all interfaces for that time (see
docs/operations.md, "Security").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from replay_service.backends.reverb import internals as reverb_internals
from replay_service.config.options import Timeouts, to_ms
from replay_service.errors import WriteTimeoutError
from replay_service.storage.export import ExportedItems

if TYPE_CHECKING:
    import reverb

    from replay_service.backends.reverb.handles import TableHandle
    from replay_service.specs.layouts import Layout

_UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def read_items(handle: TableHandle, checkpoint_path: str) -> ExportedItems:
    """Every item of one table, exactly once, oldest first, from a checkpoint (see module docs).

    Args:
      handle: The table.
      checkpoint_path: A complete checkpoint of its server, readable from this machine.

    Returns:
      The items, one array per field of the stored spec (a packed table's rows unpacked).

    Raises:
      CheckpointError: If the checkpoint cannot be read or decoded.
    """
    data, priorities, times_sampled = reverb_internals.read_checkpoint_items(
        checkpoint_path, handle.name, handle.stored_signature, handle.timeouts.sample
    )
    # A packed table's one uint8 column [items, sequence_length, step_bytes]: back to one
    # array per field.
    data = handle.layout.decode_columns(data)
    return ExportedItems(data=data, priorities=priorities, times_sampled=times_sampled)


# --------------------------------------------------------------------------- inserting


def insert_items(
    client: reverb.Client,
    table_name: str,
    sequence_length: int,
    items: ExportedItems,
    timeouts: Timeouts,
    layout: Layout,
) -> None:
    """Inserts items in order with their priorities, sharing steps repeated by the next item.

    Args:
      client: Client of the server holding the (empty) table, which hands out its item
        writers (`collect.writing.ItemWritingClient`: a `BoundedClient`).
      table_name: Table to insert into.
      sequence_length: Steps per item.
      items: What to insert, oldest first.
      timeouts: `timeouts.write` bounds every wait for the server.
      layout: The table's layout: items are stored as it stores them (`encode_columns`), in
        its writers' chunks (`client.item_writer`).

    Raises:
      WriteTimeoutError: If the server does not confirm the items in time.
    """
    from replay_service.collect.observer import MAX_IN_FLIGHT_ITEMS

    if items.num_items == 0:
        return
    timeout_ms = to_ms(timeouts.write)
    data = layout.encode_columns(items.data)
    # A frame-stacked table's item also holds its first stack's earlier frames.
    sequence_length = int(data[0].shape[1])
    continues = _continues_previous(data, sequence_length)
    priorities = items.priorities.tolist()
    with client.item_writer(layout, sequence_length) as writer:
        for index, priority in enumerate(priorities):
            first = sequence_length - 1 if continues[index] else 0
            for step in range(first, sequence_length):
                writer.append([column[index, step] for column in data])
            trajectory = [column[-sequence_length:] for column in writer.history]
            writer.create_item(table_name, priority, trajectory)
            if (index + 1) % MAX_IN_FLIGHT_ITEMS == 0:
                _wait(lambda: writer.flush(MAX_IN_FLIGHT_ITEMS // 2, timeout_ms=timeout_ms))
        _wait(lambda: writer.end_episode(clear_buffers=True, timeout_ms=timeout_ms))


def _continues_previous(data: list[np.ndarray], sequence_length: int) -> np.ndarray:
    """Per item: whether its first L-1 steps are byte-identical to the previous item's last."""
    count = data[0].shape[0] if data else 0
    same = np.zeros([count], dtype=bool)
    if sequence_length < 2 or count < 2:
        return same
    same[1:] = True
    for column in data:
        unsigned = _UNSIGNED_OF_SIZE.get(column.dtype.itemsize)
        if unsigned is None or column.dtype.hasobject:
            return np.zeros([count], dtype=bool)
        bits = column.view(unsigned)
        equal = bits[1:, :-1] == bits[:-1, 1:]
        same[1:] &= equal.all(axis=tuple(range(1, equal.ndim)))
    return same


def _wait(call: Any) -> None:
    import reverb

    try:
        call()
    except reverb.errors.DeadlineExceededError as e:
        raise WriteTimeoutError(
            f"imported items were not confirmed within the write timeout: {e}"
        ) from e
