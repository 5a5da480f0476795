"""The local checkpoint files written and read directly: `write` records what `verify` reads
back, the index names the tables in order, restores refill `LocalTable`s item for item, and
every missing, damaged, foreign or mismatched file is refused naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_service.backends.local import checkpoint as ckpt
from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError, SpecMismatchError, UnknownFormatError
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.nests import describe_spec
from replay_service.storage.export import ExportedItems
from replay_service.storage.files import DONE_FILE
from replay_service.storage.metadata import Checkpoint

pytestmark = pytest.mark.local

STORED = {"x": ArraySpec((2,), np.float32), "n": ArraySpec((), np.int64)}
LENGTH = 2
CONFIGS = [TableConfig("a", 8, LENGTH), TableConfig("b", 8, LENGTH)]


def items(count: int, base: int) -> ExportedItems:
    rng = np.random.default_rng(base)
    return ExportedItems(
        data=[
            base + np.arange(count * LENGTH, dtype=np.int64).reshape(count, LENGTH),
            rng.random((count, LENGTH, 2)).astype(np.float32),
        ],
        priorities=rng.random(count) + 0.5,
        times_sampled=np.arange(count, dtype=np.int32),
    )


@pytest.fixture
def written(tmp_path: Path) -> tuple[str, int, dict[str, Any], list[ExportedItems]]:
    path = str(tmp_path / "ckpt")
    tables = [items(3, 0), items(5, 100)]
    num_items, files = ckpt.write(
        path, [(config, STORED, t) for config, t in zip(CONFIGS, tables, strict=True)]
    )
    return path, num_items, files, tables


def empty_tables() -> list[LocalTable]:
    return [LocalTable(config, describe_spec(STORED), seed=0) for config in CONFIGS]


def recorded(path: str, files: dict[str, Any], num_items: int) -> Checkpoint:
    return Checkpoint(path, 1, {"files": files, "num_items": num_items})


def test_written_files_verify_as_recorded_and_list_the_tables_in_order(written) -> None:
    path, num_items, files, _ = written
    assert num_items == 8
    assert ckpt.verify(path) == (num_items, files)
    assert ckpt.is_local_checkpoint(path)
    assert ckpt.read_index(path) == ["a", "b"]
    names = ["table0.state.safetensors", "table0.metadata.json"]
    names += ["table1.state.safetensors", "table1.metadata.json"]
    assert sorted(os.listdir(path)) == sorted([ckpt.INDEX_FILE, DONE_FILE, *names])
    assert sorted(ckpt.recorded_names(path)) == sorted(files) == sorted([ckpt.INDEX_FILE, *names])
    assert ckpt.small_files(path) == [
        ckpt.INDEX_FILE,
        "table0.metadata.json",
        "table1.metadata.json",
    ]
    assert ckpt.CHECKPOINT_FORMAT.owns(["x", ckpt.INDEX_FILE])
    assert ckpt.CHECKPOINT_FORMAT.owns(["table3.state.safetensors"])
    assert not ckpt.CHECKPOINT_FORMAT.owns(["items.tfrecord", DONE_FILE])
    assert ckpt.CHECKPOINT_FORMAT.verify(path) == (num_items, files)


def test_restore_refills_each_table_item_for_item(written) -> None:
    path, num_items, files, tables = written
    restored = empty_tables()
    ckpt.check_restorable(recorded(path, files, num_items), ["a", "b"])
    ckpt.restore_tables(recorded(path, files, num_items), STORED, restored)
    for table, want in zip(restored, tables, strict=True):
        data, priorities, times = table.items()
        for got, field in zip(data, want.data, strict=True):
            np.testing.assert_array_equal(got, field)
        np.testing.assert_array_equal(priorities, want.priorities)
        np.testing.assert_array_equal(times, want.times_sampled)


def test_writing_into_an_existing_directory_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"cannot create checkpoint directory '.*File exists"):
        ckpt.write(str(tmp_path), [(CONFIGS[0], STORED, items(1, 0))])


def test_a_checkpoint_without_done_is_incomplete(written) -> None:
    path = written[0]
    os.remove(os.path.join(path, DONE_FILE))
    with pytest.raises(CheckpointError, match=r"local checkpoint '.*ckpt' is incomplete \(no DONE"):
        ckpt.verify(path)


def test_a_state_file_that_reads_back_otherwise_fails_verification(written) -> None:
    path = written[0]
    state = os.path.join(path, "table1.state.safetensors")
    with open(state, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"table1\.state\.safetensors' does not read back"):
        ckpt.verify(path)


@pytest.mark.parametrize(
    ("content", "error", "match"),
    [
        (
            "{not json",
            CheckpointError,
            r"checkpoint index '.*local_checkpoint\.json' cannot be read",
        ),
        ("[1, 2]", CheckpointError, r"is not a .* index: \[1, 2\]"),
        ('{"format": "FORMAT", "tables": "a"}', CheckpointError, r"is not a .* index: .*'a'"),
        ('{"format": "FORMAT", "tables": [1]}', CheckpointError, r"is not a .* index: .*\[1\]"),
        ('{"format": "someone.else/1", "tables": []}', UnknownFormatError, "someone.else/1"),
    ],
)
def test_a_malformed_index_is_refused_naming_it(written, content, error, match) -> None:
    path = written[0]
    with open(os.path.join(path, ckpt.INDEX_FILE), "w") as f:
        f.write(content.replace("FORMAT", ckpt.FORMAT))
    with pytest.raises(error, match=match):
        ckpt.read_index(path)


def test_a_newer_version_of_the_format_is_unknown_not_damage(written) -> None:
    path = written[0]
    newer = ckpt.FORMAT.rsplit("/", 1)[0] + "/99"
    with open(os.path.join(path, ckpt.INDEX_FILE), "w") as f:
        json.dump({"format": newer, "tables": ["a", "b"]}, f)
    with pytest.raises(UnknownFormatError, match=newer):
        ckpt.verify(path)


def test_a_reverb_checkpoint_is_refused_saying_how_to_move_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a Reverb checkpoint; .* export\(\) it"):
        ckpt.check_restorable(Checkpoint(str(tmp_path), 1, {"files": {}}), ["a"])


def test_restorability_needs_digests_matching_small_files_and_the_same_tables(written) -> None:
    path, num_items, files, _ = written
    with pytest.raises(CheckpointError, match="records no file digests"):
        ckpt.check_restorable(Checkpoint(path, 1, {}), ["a", "b"])
    with pytest.raises(CheckpointError, match=r"holds tables \['a', 'b'\], not the configured"):
        ckpt.check_restorable(recorded(path, files, num_items), ["b", "a"])
    metadata = os.path.join(path, "table1.metadata.json")
    with open(metadata, "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match=r"table1\.metadata\.json' has \d+ bytes"):
        ckpt.check_restorable(recorded(path, files, num_items), ["a", "b"])


def test_a_restore_that_finds_other_counts_than_recorded_is_refused(written) -> None:
    path, _, files, _ = written
    with pytest.raises(CheckpointError, match=r"gave 8 items, but 9 were recorded"):
        ckpt.restore_tables(recorded(path, files, 9), STORED, empty_tables())


def test_restoring_into_another_spec_or_length_is_a_spec_mismatch(written) -> None:
    path = written[0]
    other = {"x": ArraySpec((3,), np.float32), "n": ArraySpec((), np.int64)}
    table = LocalTable(CONFIGS[0], describe_spec(other), seed=0)
    with pytest.raises(SpecMismatchError):
        ckpt.restore_table(path, 0, other, table)
    longer = LocalTable(TableConfig("a", 8, LENGTH + 1), describe_spec(STORED), seed=0)
    with pytest.raises(SpecMismatchError):
        ckpt.restore_table(path, 0, STORED, longer)
    assert table.size == 0 and longer.size == 0
