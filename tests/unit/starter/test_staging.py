"""`starter.staging`: hidden siblings, the checks before a copy target is written or replaced,
and the swap that puts a complete directory in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replay_service.errors import CheckpointError, CheckpointExistsError
from replay_service.starter.staging import (
    COPY_TAG,
    check_copy_target,
    check_distinct,
    check_own_entries,
    hidden_sibling,
    install,
    locked_if_store,
)
from replay_service.storage.directory import CHECKPOINTS_DIR, LOCK_FILE, REVERB_DIR, STORE_FILE
from replay_service.storage.store import CheckpointStore


def store_dir(path: Path, marker: str = "old") -> Path:
    """A directory holding only replay_service's own entries (a store file and its dirs)."""
    (path / CHECKPOINTS_DIR).mkdir(parents=True)
    (path / REVERB_DIR).mkdir()
    (path / STORE_FILE).write_text(marker)
    return path


def test_a_hidden_sibling_is_beside_the_path_and_names_this_process(tmp_path):
    sibling = hidden_sibling(str(tmp_path / "buffer"), COPY_TAG)
    assert sibling == str(tmp_path / f".buffer.copy-{os.getpid()}")


@pytest.mark.parametrize(
    ("source", "target"), [("a", "a"), ("a", "a/b"), ("a/b", "a"), ("a/./b", "a/b/c")]
)
def test_overlapping_paths_are_refused_naming_both(tmp_path, source, target):
    with pytest.raises(CheckpointError, match="the source and target overlap") as raised:
        check_distinct(str(tmp_path / source), str(tmp_path / target))
    assert repr(str(tmp_path / source)) in str(raised.value)


def test_siblings_sharing_a_name_prefix_do_not_overlap(tmp_path):
    check_distinct(str(tmp_path / "buf"), str(tmp_path / "buffer"))
    check_distinct(str(tmp_path / "buffer"), str(tmp_path / "buf"))


def test_a_link_to_the_source_overlaps_it(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "src")
    with pytest.raises(CheckpointError, match="overlap"):
        check_distinct(str(tmp_path / "src"), str(tmp_path / "link" / "inner"))


def test_copy_targets_that_are_used_as_they_are(tmp_path):
    assert check_copy_target(str(tmp_path / "new"), overwrite=False) is False
    (tmp_path / "empty").mkdir()
    assert check_copy_target(str(tmp_path / "empty"), overwrite=False) is False


def test_a_buffer_in_the_target_is_replaced_only_with_overwrite(tmp_path):
    target = str(store_dir(tmp_path / "t"))
    with pytest.raises(CheckpointExistsError, match=r"'.*/t' is not empty.*overwrite=True"):
        check_copy_target(target, overwrite=False)
    assert check_copy_target(target, overwrite=True) is True


def test_targets_that_are_never_written_are_refused_naming_them(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="'.*/file' exists and is not a directory"):
        check_copy_target(str(tmp_path / "file"), overwrite=True)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    with pytest.raises(CheckpointError, match=r"'.*/link' is a symbolic link \(to '.*/dir'\)"):
        check_copy_target(str(tmp_path / "link"), overwrite=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        check_copy_target(str(tmp_path / "dangling"), overwrite=True)
    foreign = store_dir(tmp_path / "foreign")
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"contains notes.txt\).*never replaced"):
        check_copy_target(str(foreign), overwrite=True)


def test_only_a_store_of_own_entries_may_be_replaced(tmp_path):
    check_own_entries(str(store_dir(tmp_path / "own")))
    lockfile_only = tmp_path / "no_store"
    lockfile_only.mkdir()
    (lockfile_only / LOCK_FILE).write_text("")
    # Nothing foreign in it, but no store file either: the message shows what it holds.
    with pytest.raises(CheckpointError, match=rf"contains {LOCK_FILE}\)"):
        check_own_entries(str(lockfile_only))


def test_locked_if_store_refuses_a_buffer_in_use_and_skips_other_paths(tmp_path):
    with locked_if_store(str(tmp_path / "not_there"), False):
        pass
    target = str(store_dir(tmp_path / "t"))
    with CheckpointStore(target).locked():
        with pytest.raises(CheckpointError, match="in use"):
            with locked_if_store(target, True):
                pytest.fail("the block ran while another holder had the lock")
    with locked_if_store(target, True):
        pass  # free again


def test_install_moves_staging_into_a_new_or_empty_target(tmp_path):
    staging = tmp_path / ".t.copy-1"
    staging.mkdir()
    (staging / "data").write_text("new")
    install(str(staging), str(tmp_path / "t"))
    assert (tmp_path / "t" / "data").read_text() == "new" and not staging.exists()
    staging.mkdir()
    (staging / "data").write_text("newer")
    (tmp_path / "empty").mkdir()
    install(str(staging), str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "data").read_text() == "newer"


def test_install_replaces_a_full_target_and_leaves_no_old_copy(tmp_path):
    target = store_dir(tmp_path / "t", marker="old")
    staging = store_dir(tmp_path / ".t.copy-1", marker="new")
    install(str(staging), str(target))
    assert (target / STORE_FILE).read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_a_failed_swap_puts_the_old_target_back_and_names_both(tmp_path, monkeypatch):
    target = store_dir(tmp_path / "t", marker="old")
    staging = tmp_path / ".t.copy-1"
    staging.mkdir()
    rename = os.rename

    def refuse_staging(src, dst):
        if src == str(staging):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_staging)
    with pytest.raises(CheckpointError, match=r"cannot move '.*\.t\.copy-1' to '.*/t'.*No space"):
        install(str(staging), str(target))
    assert (target / STORE_FILE).read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == [".t.copy-1", "t"]
