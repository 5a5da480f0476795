"""Adopting a bare Reverb checkpoint root: validate its newest checkpoint and copy it in.

A bare root is what Reverb's `DefaultCheckpointer` writes (e.g. an sbsim starter buffer):
time-named checkpoint directories and no replay_service metadata. `copy_buffer` hands such a
source to `copy_bare_root`, which checks what the checkpoint holds against the data spec and
writes a replay_service checkpoint directory holding it.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import tensorflow as tf

from replay_service.backends.reverb.internals import (
    ColumnType,
    StoredTable,
    bare_checkpoint_dirs,
    copy_with_signature,
    is_reverb_checkpoint,
    read_column_types,
    read_stored_tables,
    verify_files,
)
from replay_service.errors import CheckpointError, NoCheckpointError, SpecMismatchError
from replay_service.specs.nests import (
    FieldDescription,
    check_collect_spec,
    describe_spec,
    diff_descriptions,
    table_signature,
)
from replay_service.starter.staging import copy_into
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    STORE_FILE,
)
from replay_service.storage.file_modes import make_dirs
from replay_service.storage.metadata import FORMAT as CHECKPOINT_FORMAT
from replay_service.storage.metadata import StoreMetadata


def copy_bare_root(source: str, target: str, overwrite: bool, data_spec: Any) -> str:
    """`copy_buffer` for a bare Reverb checkpoint root (see there)."""
    found = bare_checkpoint_dirs(source)
    newest = found[-1]
    if not is_reverb_checkpoint(newest):
        _refuse_incomplete(source, newest, [p for p in found if is_reverb_checkpoint(p)])
    num_items, _ = verify_files(newest)
    tables = read_stored_tables(newest)
    if len(tables) != 1:
        raise CheckpointError(
            f"Reverb checkpoint {newest!r} holds {len(tables)} tables "
            f"{[t.name for t in tables]}; only a checkpoint of one table can be copied"
        )
    table = tables[0]
    if table.num_items != num_items or table.sequence_length is None:
        raise CheckpointError(
            f"table {table.name!r} of Reverb checkpoint {newest!r} holds {table.num_items} "
            f"items of {num_items} in the checkpoint; there is nothing to copy"
        )
    description, signature = _bare_spec(newest, table, data_spec)
    metadata = StoreMetadata(
        table_name=table.name,
        sequence_length=table.sequence_length,
        capacity=table.max_size,
        data_spec=description,
    )
    return copy_into(
        newest,
        target,
        overwrite,
        lambda dest: _write_bare_copy(newest, table.name, signature, metadata, dest),
    )


def _refuse_incomplete(root: str, newest: str, complete: list[str]) -> None:
    """Raises the error of a bare root whose newest checkpoint lacks `DONE` (see `copy_buffer`).

    Raises:
      CheckpointError: Always; `NoCheckpointError` if no checkpoint of the root is complete.
    """
    message = (
        f"the newest checkpoint of Reverb checkpoint root {root!r}, {newest!r}, is incomplete "
        "(no DONE file): the save writing it is still running or was interrupted. Nothing was "
        "copied. If its writer still runs, wait until the save finishes and copy again; "
    )
    if not complete:
        raise NoCheckpointError(
            message + "if it was interrupted, the root holds no complete checkpoint to copy"
        )
    raise CheckpointError(
        message + f"if it was interrupted, move {newest!r} out of the root (it is never deleted "
        f"here) to copy the previous complete checkpoint {complete[-1]!r}, which lacks "
        "whatever that save held"
    )


def _bare_spec(checkpoint: str, table: StoredTable, data_spec: Any) -> tuple[list[Any], Any]:
    """The per-step spec description and the table signature a bare checkpoint's copy gets.

    Raises:
      SpecMismatchError: If the stored signature or the stored columns differ from
        `data_spec`, or the signature's leading dimension from the items' length.
      CheckpointError: If the table has no signature and no `data_spec` is given, or its
        signature differs from its stored columns.
    """
    length = table.sequence_length
    assert length is not None
    stored = None
    if table.signature is not None:
        leading = {f["shape"][0] if f["shape"] else None for f in describe_spec(table.signature)}
        if not leading <= {None, length}:
            raise SpecMismatchError(
                f"table {table.name!r} of {checkpoint!r}: the signature's leading dimensions "
                f"{sorted(leading, key=str)} differ from the items' sequence length {length}"
            )
        stored = [{**f, "shape": f["shape"][1:]} for f in describe_spec(table.signature)]
    if data_spec is not None:
        spec = check_collect_spec(data_spec, "copy_buffer")
        wanted = describe_spec(spec)
        problems = diff_descriptions(wanted, stored) if stored is not None else []
        problems = problems or diff_columns(wanted, read_column_types(checkpoint, table.name))
        if problems:
            raise SpecMismatchError(
                f"table {table.name!r} of {checkpoint!r} does not hold the given data_spec: "
                + "; ".join(problems)
            )
        return wanted, table_signature(spec, length)
    if stored is None:
        raise CheckpointError(
            f"table {table.name!r} of {checkpoint!r} has no signature (sbsim's and TF-Agents' "
            "ReverbReplayBuffer tables have none); pass data_spec (e.g. agent.collect_data_spec "
            "or sbsim's manager.data_spec), or --data-spec to replay-populate, to say what it "
            "holds"
        )
    problems = diff_columns(stored, read_column_types(checkpoint, table.name))
    if problems:
        raise CheckpointError(
            f"table {table.name!r} of {checkpoint!r}: its signature does not describe its "
            "items: " + "; ".join(problems)
        )
    signature = tf.nest.map_structure(
        lambda s: tf.TensorSpec([length, *s.shape[1:]], s.dtype, s.name), table.signature
    )
    return stored, signature


def diff_columns(fields: list[FieldDescription], columns: list[ColumnType]) -> list[str]:
    """Lists how a per-step spec departs from the columns a table's items are stored in.

    Fields and columns pair up in order (items store the flattened spec). When their counts
    differ by one, the field or column without a partner is named if pairing up the rest
    leaves no other difference.

    Args:
      fields: The spec's `describe_spec` description.
      columns: The stored columns (`reverb_internals.read_column_types`); empty for a table
        without items, which matches any spec.

    Returns:
      Human-readable differences, empty when the spec describes the columns.
    """
    if not columns:
        return []
    if len(fields) == len(columns):
        return [
            f"field {f['path']!r}: the data_spec says {_field_type(f)}, the stored items hold {c}"
            for f, c in zip(fields, columns, strict=True)
            if not _fits(f, c)
        ]
    if len(fields) == len(columns) + 1:
        for i, field in enumerate(fields):
            if _all_fit(fields[:i] + fields[i + 1 :], columns):
                return [
                    f"field {field['path']!r} ({_field_type(field)}) is not in the stored items"
                ]
    if len(columns) == len(fields) + 1:
        for i, column in enumerate(columns):
            if _all_fit(fields, columns[:i] + columns[i + 1 :]):
                where = ", ".join(
                    f"{side} field {fields[j]['path']!r}"
                    for side, j in (("after", i - 1), ("before", i))
                    if 0 <= j < len(fields)
                )
                return [
                    f"the stored items have a column {column} (column {i + 1} of "
                    f"{len(columns)}, {where}) for which the data_spec has no field"
                ]
    described = ", ".join(f"{f['path']}: {_field_type(f)}" for f in fields)
    return [
        f"the data_spec has {len(fields)} fields ({described}), the stored items have "
        f"{len(columns)} columns ({', '.join(map(str, columns))})"
    ]


def _field_type(field: FieldDescription) -> str:
    return f"{field['dtype']}{list(field['shape'])}"


def _fits(field: FieldDescription, column: ColumnType) -> bool:
    shape = list(field["shape"])
    return (
        field["dtype"] == column.dtype
        and len(shape) == len(column.shape)
        and all(d is None or d == c for d, c in zip(shape, column.shape, strict=True))
    )


def _all_fit(fields: list[FieldDescription], columns: list[ColumnType]) -> bool:
    return all(_fits(f, c) for f, c in zip(fields, columns, strict=True))


def _write_bare_copy(
    checkpoint: str, table_name: str, signature: Any, metadata: StoreMetadata, dest: str
) -> None:
    """Writes the store file and `checkpoint`, as the first checkpoint, into `dest`."""
    with open(os.path.join(dest, STORE_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata.to_json(), f, indent=2, sort_keys=True)
    first = os.path.join(dest, CHECKPOINTS_DIR, f"{CHECKPOINT_PREFIX}{1:08d}")
    make_dirs(os.path.dirname(first))
    copy_with_signature(checkpoint, table_name, signature, first)
    num_items, files = verify_files(first)
    info = {
        "format": CHECKPOINT_FORMAT,
        "sequence": 1,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "reverb_name": os.path.basename(checkpoint),
        "num_items": num_items,
        "files": {name: {"size": f["size"], "sha256": f["sha256"]} for name, f in files.items()},
        "store": metadata.to_json(),
        "copied_from": {"path": checkpoint, "reverb_checkpoint_root": os.path.dirname(checkpoint)},
    }
    with open(os.path.join(first, CHECKPOINT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
