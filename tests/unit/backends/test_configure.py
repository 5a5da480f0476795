"""`configure`: a manager's backend arguments checked in order, and the options a backend is
built from (the tables with one layout, the defaults filled in)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_service.backends.configure import configure
from replay_service.config.options import SamplingConfig, TableConfig, Timeouts
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import ArraySpec, trajectory_spec

SPEC = trajectory_spec(
    ArraySpec((4,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)


def arguments(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """`configure`'s arguments as a manager's defaults give them, with `changes`."""
    defaults: dict[str, Any] = {
        "data_spec": SPEC,
        "capacity": 100,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "sequence_length": 2,
        "table_name": "uniform_table",
        "sampling": None,
        "server_address": None,
        "port": None,
        "timeouts": None,
        "keep_checkpoints": 3,
        "stride_length": 1,
        "extra_tables": (),
        "pad_end_of_episode": False,
        "checkpoint_interval_s": None,
        "backend": "local",
        "storage": "memory",
        "layout": "auto",
        "seed": None,
        "device": None,
    }
    return defaults | changes


def test_the_options_hold_the_table_and_the_defaults(tmp_path: Path) -> None:
    implementation, options = configure(**arguments(tmp_path))
    assert implementation.kind == "local"
    (table,) = options.tables
    assert table == TableConfig(
        "uniform_table", 100, 2, sampling=SamplingConfig(), layout=table.layout
    )
    assert options.timeouts == Timeouts()
    assert options.checkpoint_dir == str(tmp_path / "ckpt")
    assert not options.layout_from_server
    assert options.stored_spec == SPEC  # unpadded: the spec as given


def test_extra_tables_left_nested_take_the_managers_layout(tmp_path: Path) -> None:
    extra = [TableConfig("second", 10, 3), TableConfig("third", 10, 1)]
    _, options = configure(
        **arguments(tmp_path, backend="reverb", layout="packed", extra_tables=extra)
    )
    assert [(t.name, t.sequence_length, t.layout) for t in options.tables] == [
        ("uniform_table", 2, "packed"),
        ("second", 3, "packed"),
        ("third", 1, "packed"),
    ]


def test_a_remote_server_with_layout_auto_takes_its_tables_layout(tmp_path: Path) -> None:
    _, options = configure(
        **arguments(tmp_path, backend="reverb", server_address="localhost:1", checkpoint_dir=None)
    )
    assert options.layout_from_server and options.checkpoint_dir is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        # The backend name is checked first, then the table, then the manager's integers.
        ({"backend": "disk", "capacity": -1}, r"backend must be one of .* got 'disk'"),
        ({"capacity": 0, "keep_checkpoints": -1}, "capacity must be a positive integer, got 0"),
        ({"stride_length": 0}, "stride_length must be an integer >= 1, got 0"),
        ({"checkpoint_dir": None}, "checkpoint_dir is required unless server_address is given"),
        ({"checkpoint_interval_s": -1.0}, r"checkpoint_interval_s .* -1\.0"),
        ({"port": 8000}, "port=8000: .* not available with the local backend"),
    ],
)
def test_the_first_invalid_argument_is_named(tmp_path: Path, changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        configure(**arguments(tmp_path, **changes))


def test_an_interval_with_a_remote_server_names_the_servers_own_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_interval_s=60 applies only to the embedded"):
        configure(
            **arguments(
                tmp_path,
                backend="reverb",
                server_address="localhost:1",
                checkpoint_dir=None,
                checkpoint_interval_s=60,
            )
        )


def test_a_spec_that_is_not_a_trajectory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecMismatchError):
        configure(**arguments(tmp_path, data_spec={"observation": ArraySpec((4,), np.float32)}))


def test_nothing_is_created_or_written(tmp_path: Path) -> None:
    configure(**arguments(tmp_path, storage="memmap"))
    assert list(tmp_path.iterdir()) == []


def test_compression_reaches_the_local_backend(tmp_path: Path) -> None:
    implementation, options = configure(**arguments(tmp_path), compression="lz4")
    assert options.compression == "lz4"
    assert implementation.from_options(options).compression == "lz4"
    _, options = configure(**arguments(tmp_path))
    assert options.compression is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"compression": "brotli"}, r"one of \['lz4', 'none', 'zstd'\] or None, got 'brotli'"),
        (
            {"compression": "zstd", "storage": "memmap"},
            r"compression='zstd' needs storage='memory', got storage='memmap': compressed "
            "steps have variable sizes",
        ),
        (
            {"compression": "lz4", "device": "cpu"},
            r"compression='lz4' needs device=None, got device='cpu'",
        ),
        (
            {"compression": "zstd", "backend": "reverb"},
            r"compression='zstd'.*not available with .*Reverb.*Reverb compresses its chunks "
            "itself",
        ),
    ],
)
def test_a_compression_the_backend_cannot_take_is_refused(
    tmp_path: Path, changes: dict, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        configure(**arguments(tmp_path, **changes))
