"""`scratch`: the directory of a "memmap" table's files and their disk space.

A directory that is a symbolic link, lies under one, is a file, or holds anything the
memory-mapped storage did not create is refused before anything changes; only the table's own
`field<N>.memmap` files are ever deleted; files that do not fit on the disk are refused before
any is created, and a reservation failing part way leaves none behind. Imports no TensorFlow,
TF-Agents or Reverb.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from replay_service.backends.local import scratch
from replay_service.errors import CheckpointError, ConfigError
from replay_service.storage.file_modes import DIR_MODE

pytestmark = pytest.mark.local


FIELDS = [{"path": "observation", "dtype": "uint8", "shape": [4096]}]
"""The step the reserved files hold (named in the errors)."""


def entries(directory: Path) -> dict[str, bytes]:
    """Every file directly in `directory` and its contents."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_scratch_file_names_are_the_ones_prepare_deletes(tmp_path: Path) -> None:
    """The files `scratch_file` names are the only ones `prepare_scratch_dir` clears."""
    directory = tmp_path / ".memmap" / "table"
    directory.mkdir(parents=True)
    for index in (0, 1, 12):
        Path(scratch.scratch_file(str(directory), index)).write_bytes(b"old")
    assert sorted(os.listdir(directory)) == ["field0.memmap", "field1.memmap", "field12.memmap"]
    scratch.prepare_scratch_dir(str(directory))
    assert os.listdir(directory) == []


def test_a_missing_directory_is_accepted_and_created_with_its_parent(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints" / ".memmap" / "table"
    scratch.check_scratch_dir(str(directory))
    assert not directory.parent.exists(), "the check created something"
    scratch.prepare_scratch_dir(str(directory))
    assert directory.is_dir() and not directory.is_symlink()
    assert stat.S_IMODE(directory.stat().st_mode) == DIR_MODE
    assert stat.S_IMODE(directory.parent.stat().st_mode) == DIR_MODE


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_a_directory_without_a_plain_name_is_refused(tmp_path: Path, name: str) -> None:
    path = os.path.join(str(tmp_path), name) if name else str(tmp_path) + os.sep
    with pytest.raises(CheckpointError, match="is not a plain file name"):
        scratch.prepare_scratch_dir(path)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links")
@pytest.mark.parametrize("linked", ["directory", "parent"])
def test_a_symlinked_directory_or_parent_is_refused_and_its_target_kept(
    tmp_path: Path, linked: str
) -> None:
    """The link's target keeps every file, the table's own names included."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "field0.memmap").write_bytes(b"someone's data")
    (target / "notes.txt").write_bytes(b"kept")
    if linked == "directory":
        (tmp_path / ".memmap").mkdir()
        directory = tmp_path / ".memmap" / "table"
        directory.symlink_to(target, target_is_directory=True)
        link = directory
    else:
        link = tmp_path / ".memmap"
        link.symlink_to(target, target_is_directory=True)
        directory = link / "table"
    before = entries(target)
    with pytest.raises(CheckpointError, match=rf"'{link}' is a symbolic link \(to '{target}'\)"):
        scratch.prepare_scratch_dir(str(directory))
    assert entries(target) == before
    assert link.is_symlink()


def test_a_file_in_place_of_the_directory_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / ".memmap").mkdir()
    path = tmp_path / ".memmap" / "table"
    path.write_bytes(b"a file")
    with pytest.raises(CheckpointError, match=rf"'{path}' exists and is not a directory"):
        scratch.prepare_scratch_dir(str(path))
    assert path.read_bytes() == b"a file"


def test_a_directory_holding_foreign_entries_is_refused_and_nothing_deleted(
    tmp_path: Path,
) -> None:
    """A foreign file beside the table's own: neither is deleted, the message names it."""
    directory = tmp_path / ".memmap" / "table"
    directory.mkdir(parents=True)
    (directory / "field0.memmap").write_bytes(b"an earlier buffer's")
    (directory / "model.pt").write_bytes(b"weights")
    before = entries(directory)
    with pytest.raises(
        CheckpointError, match=r"did not create \('model.pt'\); nothing was deleted"
    ):
        scratch.prepare_scratch_dir(str(directory))
    assert entries(directory) == before


def test_an_entry_with_the_tables_name_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "table"
    (directory / "field1.memmap").mkdir(parents=True)
    (directory / "field1.memmap" / "inside").write_bytes(b"kept")
    with pytest.raises(CheckpointError, match=r"\('field1.memmap'\)"):
        scratch.prepare_scratch_dir(str(directory))
    assert (directory / "field1.memmap" / "inside").read_bytes() == b"kept"


def test_reserve_files_allocates_every_file_whole(tmp_path: Path) -> None:
    files = [(str(tmp_path / "field0.memmap"), 4096), (str(tmp_path / "field1.memmap"), 0)]
    scratch.reserve_files(files, "two fields", FIELDS)
    for path, size in files:
        info = os.stat(path)
        assert info.st_size == size
        assert info.st_blocks * 512 >= size, f"{path}: its blocks were not allocated"
        assert stat.S_IMODE(info.st_mode) == 0o600


def test_files_larger_than_the_free_space_are_refused_before_any_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the error names the bytes needed and free; no file is created."""
    monkeypatch.setattr(scratch, "free_bytes", lambda directory: 1000)
    files = [(str(tmp_path / "field0.memmap"), 600), (str(tmp_path / "field1.memmap"), 600)]
    with pytest.raises(
        ConfigError, match=r"cannot reserve 1200 bytes .*on disk for two fields .*\(1000 bytes free"
    ):
        scratch.reserve_files(files, "two fields", FIELDS)
    assert os.listdir(tmp_path) == []


def test_a_reservation_failing_part_way_removes_the_files_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up at the second file: the first is removed, the error names the second."""
    allocate = os.posix_fallocate
    calls = []

    def fill_up(fd: int, offset: int, size: int) -> None:
        calls.append(size)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", fill_up)
    second = str(tmp_path / "field1.memmap")
    files = [(str(tmp_path / "field0.memmap"), 4096), (second, 8192)]
    with pytest.raises(ConfigError, match=rf"'{second}' \(8192 bytes\): No space left on device"):
        scratch.reserve_files(files, "two fields", FIELDS)
    assert calls == [4096, 8192]
    assert os.listdir(tmp_path) == []


def test_reserve_files_never_replaces_an_existing_file(tmp_path: Path) -> None:
    """A file already there (a foreign one, a link) is refused, kept, and the files this call
    created before it are removed."""
    (tmp_path / "field1.memmap").write_bytes(b"kept")
    files = [(str(tmp_path / "field0.memmap"), 16), (str(tmp_path / "field1.memmap"), 16)]
    with pytest.raises(ConfigError, match="field1.memmap"):
        scratch.reserve_files(files, "two fields", FIELDS)
    assert entries(tmp_path) == {"field1.memmap": b"kept"}


def test_free_bytes_of_a_directory_and_of_a_missing_path(tmp_path: Path) -> None:
    free = scratch.free_bytes(str(tmp_path))
    assert isinstance(free, int) and free > 0
    # A directory not made yet is measured on the disk of its nearest existing parent.
    missing = scratch.free_bytes(str(tmp_path / "missing" / "deeper"))
    assert isinstance(missing, int) and missing > 0
