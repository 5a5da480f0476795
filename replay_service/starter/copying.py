"""`copy_buffer`: a training run's own copy of a buffer's newest checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from replay_service.backends.reverb.internals import bare_checkpoint_dirs
from replay_service.config.options import validate_path
from replay_service.errors import NoCheckpointError, SpecMismatchError
from replay_service.specs.nests import check_collect_spec, describe_spec, diff_descriptions
from replay_service.starter.adoption import copy_bare_root
from replay_service.starter.staging import check_distinct, copy_into
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    STORE_FILE,
)
from replay_service.storage.store import CheckpointStore


def copy_buffer(
    source_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    data_spec: Any = None,
) -> str:
    """Copies the newest complete checkpoint of a buffer into a new checkpoint directory.

    The target gets the same layout with only that checkpoint, renumbered as the first:
    `replay_service.json`, `checkpoints/ckpt-...1/` and an empty `.reverb/`. It is written to a
    hidden sibling and renamed into place, so it never exists half-copied. The source is only
    read. `ReplayBufferManager(<same spec, capacity, sequence length>, checkpoint_dir=target)
    .load_replay_buffer()` then restores the copy, and collecting into it or checkpointing it
    leaves the source unchanged.

    The source may also be a bare Reverb checkpoint root, as Reverb's `DefaultCheckpointer`
    writes it (e.g. an sbsim starter buffer, `starter_buffers/default/`: subdirectories named by
    time, each with `tables.tfrecord`, `chunks.tfrecord`, `items.tfrecord` and `DONE`). Its
    newest checkpoint (largest name) is read back in full and validated: exactly one table,
    with items of one sequence length, a signature that matches `data_spec` when both are
    there, and the dtype and per-step shape of every stored column (read from the chunks)
    matching the spec field for field. A table without a signature (sbsim's) needs
    `data_spec`. The copy is a normal replay_service checkpoint directory recording that
    table's name, capacity and sequence length and the data spec (`data_spec`'s, or the stored
    signature's), with the table's signature stored with the sequence length as its leading
    dimension as replay_service's tables have it.

    If the newest checkpoint directory of a bare root lacks `DONE` (a save still running, or
    one that died), nothing is copied and the error names it. Reverb itself would load the
    previous complete checkpoint instead, but that is not what the root's writer last saved:
    while a save runs it is about to be replaced (and deleted by Reverb), and after a crash the
    items of the lost save would be missing from the copy without a word.

    Args:
      source_dir: A replay_service checkpoint directory, e.g. a starter buffer, or a bare
        Reverb checkpoint root.
      target_dir: The new checkpoint directory, e.g. a training run's own one. It must not
        exist or be empty, unless `overwrite` is set.
      overwrite: Replace a target that is a replay_service checkpoint directory. A target
        holding files that are not replay_service's is never deleted.
      data_spec: The per-step data spec the buffer holds (e.g. `agent.collect_data_spec`, or
        sbsim's `ReplayBufferManager.data_spec`), a TF-Agents `Trajectory`. Required for a bare
        root whose table has no signature; otherwise checked against the source when given.

    Returns:
      The absolute target path.

    Raises:
      NoCheckpointError: If the source is missing, empty or has no complete checkpoint.
      CheckpointError: If the source is not a replay_service checkpoint directory, the newest
        checkpoint of a bare root is incomplete, the two paths overlap, the target holds
        foreign files or is in use, or copying fails.
      CheckpointExistsError: If the target is not empty and `overwrite` is False.
      SpecMismatchError: If `data_spec` is not a `Trajectory` of specs or differs from what the
        source holds; the message names each field that differs.
      ConfigError: If either path holds a NUL character (no path can); the message names it.
    """
    source = os.path.abspath(validate_path(source_dir, "copy source"))
    target = os.path.abspath(validate_path(target_dir, "copy target"))
    if not os.path.lexists(source):
        raise NoCheckpointError(f"there is no buffer {source!r} to copy: it does not exist")
    check_distinct(source, target)
    store = CheckpointStore(source)
    if not store.is_store() and bare_checkpoint_dirs(source):
        return copy_bare_root(source, target, overwrite, data_spec)
    stored = store.read_metadata()
    store.check_checkpoint_links()  # a linked newest checkpoint would be skipped for an older
    latest = store.latest()
    if latest is None:
        raise NoCheckpointError(
            f"buffer {source!r} holds no complete checkpoint to copy (it was never checkpointed)"
        )
    if data_spec is not None:
        problems = diff_descriptions(
            describe_spec(check_collect_spec(data_spec, "copy_buffer")), stored.data_spec
        )
        if problems:
            raise SpecMismatchError(
                f"buffer {source!r} does not hold the given data_spec: " + "; ".join(problems)
            )
    return copy_into(
        latest.path,
        target,
        overwrite,
        lambda dest: _write_copy(store, latest.path, latest.info, dest),
    )


def _write_copy(store: CheckpointStore, checkpoint: str, info: dict[str, Any], dest: str) -> None:
    """Writes the store file and only `checkpoint`, as the first checkpoint, into `dest`."""
    name = os.path.basename(checkpoint)
    width = len(name) - len(CHECKPOINT_PREFIX)
    first = f"{CHECKPOINT_PREFIX}{1:0{width}d}"
    checkpoints = os.path.join(dest, CHECKPOINTS_DIR)
    shutil.copy2(store.store_file, os.path.join(dest, STORE_FILE))
    shutil.copytree(checkpoint, os.path.join(checkpoints, first))
    source = {"path": checkpoint, "sequence": info.get("sequence")}
    copied = {**info, "sequence": 1, "copied_from": source}
    with open(os.path.join(checkpoints, first, CHECKPOINT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(copied, f, indent=2, sort_keys=True)
