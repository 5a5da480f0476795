"""`storage.metadata`: what a checkpoint directory records of its buffer, and each checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from replay_service.config.options import TableConfig, VariableTableConfig
from replay_service.errors import CheckpointError, SpecMismatchError, UnknownFormatError
from replay_service.specs.arrays import ArraySpec
from replay_service.storage.metadata import (
    FORMAT,
    Checkpoint,
    StoreMetadata,
    TableSummary,
    VariableTableSummary,
)
from storage_fakes import FIELD, SuffixFormat, metadata

pytestmark = pytest.mark.local

NEWER = FORMAT.rsplit("/", 1)[0] + "/99"
"""The store file's format tag of a future release."""
FORMATS = (SuffixFormat("local", ".safetensors"), SuffixFormat("reverb", ".tfrecord"))


def test_metadata_round_trips_through_its_json_form():
    full = metadata(
        extra_tables=(TableSummary(name="x", sequence_length=3, capacity=7),),
        pad_end_of_episode=True,
        variable_tables=(VariableTableSummary(name="weights", spec=[FIELD]),),
        layout="packed",
    )
    data = json.loads(json.dumps(full.to_json()))
    assert data["format"] == FORMAT
    assert StoreMetadata.from_json(data, "here") == full
    older = {k: v for k, v in data.items() if k not in ("extra_tables", "variable_tables")}
    assert StoreMetadata.from_json(older, "here").extra_tables == ()


def test_a_file_of_an_early_release_holds_one_nested_unpadded_table():
    earliest = {"format": FORMAT, "table_name": "t", "sequence_length": 2, "capacity": 100}
    read = StoreMetadata.from_json({**earliest, "data_spec": [FIELD]}, "here")
    assert read == metadata()
    assert (read.layout, read.pad_end_of_episode, read.variable_tables) == ("nested", False, ())


def test_metadata_of_an_unknown_or_newer_format_is_refused_not_damaged():
    data = {**metadata().to_json(), "format": NEWER}
    with pytest.raises(UnknownFormatError):
        StoreMetadata.from_json(data, "here")
    with pytest.raises(CheckpointError, match="malformed"):
        StoreMetadata.from_json({"format": FORMAT}, "here")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], f"store.json is not a {FORMAT} file: list"),
        ({**metadata().to_json(), "capacity": "many"}, r"store.json is malformed: ValueError"),
        ({**metadata().to_json(), "extra_tables": [{"name": "x"}]}, "malformed: KeyError"),
    ],
)
def test_metadata_that_is_no_store_file_is_refused_naming_the_source(data, message):
    with pytest.raises(CheckpointError, match=message):
        StoreMetadata.from_json(data, "store.json")


def test_for_tables_records_the_tables_the_spec_and_the_layout():
    spec = {"observation": ArraySpec((3,), np.float32)}
    table = TableConfig(name="t", capacity=100, sequence_length=2, layout="packed")
    extra = TableConfig(name="x", capacity=7, sequence_length=3, layout="packed")
    weights = VariableTableConfig(spec={"w": ArraySpec((2,), np.float64)}, name="weights")
    recorded = StoreMetadata.for_tables(table, spec, [extra], [weights])
    assert recorded == metadata(
        layout="packed",
        extra_tables=(TableSummary("x", 3, 7),),
        variable_tables=(
            VariableTableSummary("weights", [{"path": "w", "dtype": "float64", "shape": [2]}]),
        ),
    )


def test_metadata_names_every_difference_and_refuses_a_mismatch():
    stored = metadata(extra_tables=(TableSummary(name="x", sequence_length=3, capacity=7),))
    asked = metadata(
        capacity=50,
        layout="packed",
        extra_tables=(TableSummary(name="x", sequence_length=4, capacity=7),),
    )
    problems = stored.differences(asked)
    assert problems[0].startswith("capacity: requested 50, stored 100 (Reverb restores")
    assert any(p.startswith("layout: requested 'packed', stored 'nested'") for p in problems)
    assert "extra table 'x' sequence_length: requested 4, stored 3" in problems
    assert stored.differences(stored) == []
    with pytest.raises(SpecMismatchError, match="^the file does not match the configured"):
        stored.check_matches(asked, "the file")


def test_differences_name_each_table_field_in_a_fixed_order():
    stored = metadata()
    asked = metadata(table_name="u", sequence_length=3, pad_end_of_episode=True)
    assert stored.differences(asked) == [
        "table_name: requested 'u', stored 't'",
        "sequence_length: requested 3, stored 2",
        "pad_end_of_episode: requested True, stored False",
    ]


def test_differences_name_the_tables_missing_from_either_side():
    stored = metadata(extra_tables=(TableSummary("a", 2, 10), TableSummary("b", 2, 10)))
    asked = metadata(extra_tables=(TableSummary("b", 2, 11), TableSummary("c", 2, 10)))
    assert stored.differences(asked) == [
        "extra_tables: requested ['b', 'c'], stored ['a', 'b'] (missing from the checkpoint: "
        "['c']; not requested: ['a'])",
        "extra table 'b' capacity: requested 11, stored 10",
    ]


def test_differences_name_data_spec_and_variable_table_fields():
    other = {"path": "observation", "shape": [4], "dtype": "float32"}
    stored = metadata(variable_tables=(VariableTableSummary("w", [FIELD]),))
    asked = metadata(data_spec=[other], variable_tables=(VariableTableSummary("w", [other]),))
    assert stored.differences(asked) == [
        "data_spec field 'observation': expected float32[4], found float32[3]",
        "variable table 'w' spec field 'observation': expected float32[4], found float32[3]",
    ]
    renamed = metadata(variable_tables=(VariableTableSummary("v", [FIELD]),))
    assert stored.differences(renamed) == [
        "variable_tables: requested ['v'], stored ['w'] (missing from the checkpoint: ['v']; "
        "not requested: ['w'])"
    ]


def test_a_checkpoint_reads_its_count_files_and_metadata_from_its_info(tmp_path):
    info = {"num_items": 4, "files": {"a.tfrecord": {}}, "store": metadata().to_json()}
    checkpoint = Checkpoint(str(tmp_path), 3, info)
    assert checkpoint.num_items == 4 and checkpoint.files == {"a.tfrecord": {}}
    assert checkpoint.metadata == metadata()
    for bad in (True, "4", None, 4.0):
        assert Checkpoint(str(tmp_path), 3, {"num_items": bad, "files": []}).num_items is None
    assert Checkpoint(str(tmp_path), 3, {"files": []}).files is None
    with pytest.raises(CheckpointError, match=f"{tmp_path} is not a"):
        _ = Checkpoint(str(tmp_path), 3, {"store": []}).metadata


def test_a_checkpoint_backend_is_the_recorded_one_else_its_files_tell(tmp_path):
    assert Checkpoint(str(tmp_path), 1, {"backend": "reverb"}, FORMATS).backend == "reverb"
    recorded_files = {"backend": "gone", "files": {"t.safetensors": {}}}
    assert Checkpoint(str(tmp_path), 1, recorded_files, FORMATS).backend == "local"
    Path(tmp_path, "chunks.tfrecord").write_text("")
    assert Checkpoint(str(tmp_path), 1, {}, FORMATS).backend == "reverb"  # present files
    assert Checkpoint(str(tmp_path), 1, {"backend": "reverb"}).backend is None  # no formats
    assert Checkpoint(str(tmp_path / "gone"), 1, {}, FORMATS).backend is None
