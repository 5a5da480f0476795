"""Where an export goes: its two paths confined to one directory, and that directory's checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError, CheckpointExistsError, ConfigError
from replay_service.storage.export_target import (
    DEFAULT_PREFIX,
    check_target,
    export_paths,
    require_one_table,
)

pytestmark = pytest.mark.local


def test_the_two_paths_are_the_prefixed_state_and_metadata_files_in_the_directory(
    tmp_path: Path,
) -> None:
    assert export_paths(tmp_path) == (
        os.path.join(tmp_path, f"{DEFAULT_PREFIX}state.safetensors"),
        os.path.join(tmp_path, f"{DEFAULT_PREFIX}metadata.json"),
    )
    assert export_paths(str(tmp_path), "run7_")[1] == os.path.join(tmp_path, "run7_metadata.json")


@pytest.mark.parametrize("prefix", ["../x_", "a/b_", "..", "nul\0_", 3])
def test_a_prefix_that_could_leave_the_directory_is_refused_naming_it(
    tmp_path: Path, prefix: object
) -> None:
    with pytest.raises(ConfigError, match="plain file-name prefix") as caught:
        export_paths(tmp_path, prefix)  # type: ignore[arg-type]
    assert repr(prefix) in str(caught.value)


def test_a_directory_with_a_nul_character_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NUL character"):
        export_paths(f"{tmp_path}/a\0b")


def test_a_missing_or_empty_directory_takes_an_export(tmp_path: Path) -> None:
    check_target(str(tmp_path / "missing"), overwrite=False)
    check_target(str(tmp_path), overwrite=False)
    assert not (tmp_path / "missing").exists()


def test_a_non_empty_directory_is_refused_naming_its_files_unless_overwrite(
    tmp_path: Path,
) -> None:
    for name in ("a", "b", "c", "d", "e", "f"):
        (tmp_path / name).write_text("kept")
    with pytest.raises(CheckpointExistsError, match=r"it contains: a, b, c, d, e, \.\.\."):
        check_target(str(tmp_path), overwrite=False)
    check_target(str(tmp_path), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c", "d", "e", "f"]


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        check_target(str(target), overwrite=True)


def test_an_export_holds_one_table() -> None:
    require_one_table([TableConfig(name="only")], "export")
    with pytest.raises(ConfigError, match=r"import supports a buffer of one table.*'a', 'b'"):
        require_one_table([TableConfig(name="a"), TableConfig(name="b")], "import")
