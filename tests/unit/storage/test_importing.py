"""Importing an export: read whole and checked against the table it goes into, first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs import nests as specs
from replay_service.specs.arrays import ArraySpec
from replay_service.storage import export
from replay_service.storage.importing import check_compatible, read_export

pytestmark = pytest.mark.local

STORED = {"obs": ArraySpec((3,), np.float32), "action": ArraySpec((), np.int64)}
COUNT = 6


@pytest.fixture()
def exported(tmp_path: Path) -> Path:
    """An export of COUNT items of two steps; item i's observations are all i."""
    fields = specs.describe_spec(STORED)
    data = [
        np.stack([np.full([2, *f["shape"]], i, f["dtype"]) for i in range(COUNT)]) for f in fields
    ]
    items = export.ExportedItems(
        data=data,
        priorities=np.linspace(0.5, 3.0, COUNT),
        times_sampled=np.zeros([COUNT], np.int32),
    )
    table = TableConfig(name="source", capacity=10, sequence_length=2)
    export.write_export(tmp_path / "e", "p_", table, STORED, items)
    return tmp_path / "e"


def _firsts(items: Any) -> list[int]:
    return [int(x) for x in items.data[0][:, 0]]


def test_an_export_goes_into_a_table_of_another_name_and_a_larger_capacity(
    exported: Path,
) -> None:
    items = read_export(TableConfig(name="other", capacity=50), STORED, exported, "p_")
    assert _firsts(items) == list(range(COUNT))
    np.testing.assert_array_equal(items.priorities, np.linspace(0.5, 3.0, COUNT))


def test_more_items_than_the_capacity_need_drop_oldest_which_keeps_the_newest(
    exported: Path,
) -> None:
    small = TableConfig(name="small", capacity=4)
    with pytest.raises(ConfigError, match="holds 6 items but the manager's capacity is 4"):
        read_export(small, STORED, exported, "p_")
    assert _firsts(read_export(small, STORED, exported, "p_", drop_oldest=True)) == [2, 3, 4, 5]


def test_a_rate_limiter_that_would_block_the_inserts_is_refused(exported: Path) -> None:
    limited = SamplingConfig(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=2.0)
    table = TableConfig(name="t", capacity=50, sampling=limited)
    with pytest.raises(ConfigError, match=r"importing 6 items would block.*admits about 3"):
        read_export(table, STORED, exported, "p_")


def test_another_sequence_length_or_data_spec_is_refused_naming_each(exported: Path) -> None:
    with pytest.raises(SpecMismatchError, match="sequence_length: manager 3, export 2"):
        read_export(TableConfig(sequence_length=3), STORED, exported, "p_")
    other = {**STORED, "obs": ArraySpec((4,), np.float32)}
    metadata = export.read_metadata(str(exported / "p_metadata.json"))
    with pytest.raises(SpecMismatchError, match=r"does not match this manager: data_spec .*obs"):
        check_compatible(metadata, 2, other, "p_metadata.json")
    check_compatible(metadata, 2, STORED, "p_metadata.json")
