"""Importing an export: read whole and checked against the table it goes into, first

Nothing is created from an export before all of it was read and checked.

An import keeps the export's items, priorities and order; the table may have another name and
capacity (a smaller one keeps the newest items with `drop_oldest`), but its data spec and
sequence length must be the export's (`check_compatible`), and its rate limiter must admit the
inserts without waiting for samples. How the items are written back is the backend's
(`Backend.insert_items`).
"""

from __future__ import annotations

import math
import os
from typing import Any

from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs import nests as specs
from replay_service.storage.export import (
    ExportedItems,
    item_fields,
    read_metadata,
    read_state_fields,
    verify_state,
)
from replay_service.storage.export_target import DEFAULT_PREFIX, export_paths


def read_export(
    table: TableConfig,
    stored_spec: Any,
    dirpath: str | os.PathLike[str],
    prefix: str = DEFAULT_PREFIX,
    *,
    drop_oldest: bool = False,
) -> ExportedItems:
    """Reads and checks an export completely, before anything is created from it.

    The table's capacity may differ from the exported one (this is how a buffer is resized).
    Its data spec and sequence length must match the export; the table name may differ.

    Args:
      table: The table the items will go into.
      stored_spec: Its per-step stored spec.
      dirpath: Directory holding the export.
      prefix: File name prefix used by the export.
      drop_oldest: If the export holds more items than `table.capacity`, keep the newest
        `capacity` items instead of refusing.

    Returns:
      The items, oldest first.

    Raises:
      CheckpointError: If a file is missing, corrupt or truncated, or the state file's sha256
        differs from the one recorded in the metadata (naming the file and both digests).
      SpecMismatchError: If the data spec or sequence length differ (naming every field).
      ConfigError: If the items exceed the capacity without `drop_oldest`, or the table's
        samples-per-insert rate limiter would block the inserts.
    """
    state_path, metadata_path = export_paths(dirpath, prefix)
    metadata = read_metadata(metadata_path)
    check_compatible(metadata, table.sequence_length, stored_spec, metadata_path)
    verify_state(state_path, metadata, metadata_path)
    fields = item_fields(stored_spec, table.sequence_length)
    items = read_state_fields(state_path, fields, int(metadata["num_items"]))
    capacity = table.capacity
    if items.num_items > capacity:
        if not drop_oldest:
            raise ConfigError(
                f"{state_path!r} holds {items.num_items} items but the manager's capacity is "
                f"{capacity}; use a capacity >= {items.num_items}, or drop_oldest=True to keep "
                f"the newest {capacity}"
            )
        items = items.newest(capacity)
    _check_rate_limiter(table.sampling, items.num_items)
    return items


def check_compatible(
    metadata: dict[str, Any], sequence_length: int, stored_spec: Any, path: str
) -> None:
    """Checks an export's metadata against the table it goes into.

    Raises:
      SpecMismatchError: If the sequence length or the data spec differ (naming every field).
    """
    problems = []
    if metadata["sequence_length"] != sequence_length:
        problems.append(
            f"sequence_length: manager {sequence_length}, export {metadata['sequence_length']!r}"
        )
    problems += [
        f"data_spec {p}"
        for p in specs.diff_descriptions(specs.describe_spec(stored_spec), metadata["data_spec"])
    ]
    if problems:
        raise SpecMismatchError(
            f"export {path!r} does not match this manager: " + "; ".join(problems)
        )


def _check_rate_limiter(sampling: SamplingConfig, num_items: int) -> None:
    spi = sampling.samples_per_insert
    if spi is None:
        return
    allowed = sampling.min_size_to_sample + math.floor(sampling.effective_error_buffer() / spi)
    if num_items > allowed:
        raise ConfigError(
            f"importing {num_items} items would block: the table's rate limiter "
            f"(samples_per_insert={spi}) admits about {allowed} inserts before it waits for "
            "samples; import with a manager without samples_per_insert"
        )
