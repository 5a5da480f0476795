"""`backends.reverb.platform.bare_roots`: the checkpoints of a `DefaultCheckpointer` root, their
tables and column types read from the files, and a copy with a new signature; on real Reverb
checkpoints."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import reverb
import tensorflow as tf

from replay_service.backends.reverb.platform.bare_roots import (
    ColumnType,
    bare_checkpoint_dirs,
    bare_checkpoints,
    copy_with_signature,
    read_column_types,
    read_stored_tables,
)
from replay_service.errors import CheckpointError

SIGNATURE = {"obs": tf.TensorSpec([None, 3], tf.float32), "act": tf.TensorSpec([None], tf.int64)}


def _table(name: str, signature: object) -> reverb.Table:
    return reverb.Table(
        name=name,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        max_size=50,
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=signature,
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A root with one checkpoint: `t` (signature, 3 items of 2 steps), `raw` (none, 1 item)."""
    path = tmp_path_factory.mktemp("bare_root")
    server = reverb.Server(
        [_table("t", SIGNATURE), _table("raw", None), _table("empty", SIGNATURE)],
        port=None,
        checkpointer=reverb.checkpointers.DefaultCheckpointer(str(path)),
    )
    client = server.localhost_client()
    with client.trajectory_writer(num_keep_alive_refs=2) as writer:
        for i in range(3):
            for _ in range(2):
                writer.append({"obs": np.full([3], i, np.float32), "act": np.int64(i)})
            writer.create_item(
                "t", 1.0, {"obs": writer.history["obs"][-2:], "act": writer.history["act"][-2:]}
            )
        writer.create_item("raw", 1.0, [writer.history["act"][-1:]])
        writer.flush()
    client.checkpoint()
    server.stop()
    yield path


def test_checkpoints_are_listed_oldest_first_and_unfinished_saves_only_as_dirs(
    root: Path, tmp_path: Path
) -> None:
    (newer,) = bare_checkpoints(str(root))
    older = root / "2000-01-01T00:00:00+00:00"
    shutil.copytree(newer, older)
    found = [str(older), newer]
    unfinished = root / "2999-01-01T00:00:00.000000000+00:00"
    stray = root / "notes"
    unfinished.mkdir()
    stray.mkdir()
    try:
        assert bare_checkpoints(str(root)) == found
        assert bare_checkpoint_dirs(str(root)) == [*found, str(unfinished)]
    finally:
        unfinished.rmdir()
        stray.rmdir()
        shutil.rmtree(older)
    assert bare_checkpoints(str(tmp_path / "missing")) == []
    assert bare_checkpoint_dirs(str(tmp_path / "missing")) == []


def test_stored_tables_name_their_size_items_length_and_signature(root: Path) -> None:
    (newer,) = bare_checkpoints(str(root))
    tables = {t.name: t for t in read_stored_tables(newer)}
    t = tables["t"]
    assert (t.max_size, t.num_items, t.sequence_length) == (50, 3, 2)
    assert t.signature == SIGNATURE
    assert (tables["raw"].num_items, tables["raw"].sequence_length) == (1, 1)
    assert tables["raw"].signature is None
    assert (tables["empty"].num_items, tables["empty"].sequence_length) == (0, None)


def test_column_types_come_from_the_chunks(root: Path) -> None:
    newer = bare_checkpoints(str(root))[-1]
    assert read_column_types(newer, "t") == [ColumnType("int64", ()), ColumnType("float32", (3,))]
    assert str(ColumnType("float32", (3,))) == "float32[3]"
    assert read_column_types(newer, "raw") == [ColumnType("int64", ())]
    assert read_column_types(newer, "empty") == []


def test_a_copy_has_the_new_signature_and_the_same_items(root: Path, tmp_path: Path) -> None:
    newer = bare_checkpoints(str(root))[-1]
    fixed = {"obs": tf.TensorSpec([2, 3], tf.float32), "act": tf.TensorSpec([2], tf.int64)}
    dest = tmp_path / "copy"
    copy_with_signature(newer, "t", fixed, str(dest))
    tables = {t.name: t for t in read_stored_tables(str(dest))}
    assert tables["t"].signature == fixed and tables["t"].num_items == 3
    assert tables["empty"].signature == SIGNATURE
    assert bare_checkpoints(str(tmp_path)) == [str(dest)]
    with pytest.raises(CheckpointError, match=r"cannot copy .* to .*copy"):
        copy_with_signature(newer, "t", fixed, str(dest))  # exists already
    assert os.path.isdir(dest)
