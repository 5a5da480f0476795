"""`storage.snapshots`: snapshot directories, moving a write out of the staging root, and
deleting only what is provably a snapshot."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from replay_service.errors import CheckpointError
from replay_service.storage import snapshots
from replay_service.storage.file_modes import DIR_MODE
from replay_service.storage.snapshots import (
    DATA_DIR,
    FORMAT,
    MARKER_FILE,
    PREFIX,
    WRITES,
    is_own_snapshot,
    new_snapshot_dir,
    remove_stale,
    write_into,
)

TOKEN = "0123456789abcdef" * 2


def own(root, name=f"{PREFIX}12-{TOKEN}", marker=None):
    path = root / name
    path.mkdir()
    if marker is not None:
        (path / MARKER_FILE).write_text(json.dumps(marker))
    return path


def test_a_new_snapshot_directory_is_named_by_pid_and_token_and_marked(tmp_path):
    holder = new_snapshot_dir(str(tmp_path / ".snapshots"))
    name = os.path.basename(holder)
    assert name.startswith(f"{PREFIX}{os.getpid()}-") and len(name.rsplit("-", 1)[1]) == 32
    assert stat.S_IMODE(os.stat(holder).st_mode) == DIR_MODE
    marker = json.loads((tmp_path / ".snapshots" / name / MARKER_FILE).read_text())
    assert marker["format"] == FORMAT and marker["pid"] == os.getpid() and marker["created_at"]
    assert os.listdir(holder) == [MARKER_FILE]
    assert is_own_snapshot(holder, name)
    assert new_snapshot_dir(str(tmp_path / ".snapshots")) != holder


def test_a_snapshot_directory_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"^cannot create snapshot directory '.*file/snap"):
        new_snapshot_dir(str(tmp_path / "file"))


def staged_writer(staging, deleted_first: int = 0):
    """Writes `written-N` into `staging`; the first `deleted_first` are deleted at once (as a
    client's later save deletes them)."""
    calls = []

    def write():
        calls.append(1)
        path = staging / f"written-{len(calls)}"
        path.mkdir()
        (path / "DONE").write_text("")
        if len(calls) <= deleted_first:
            (path / "DONE").unlink()
            path.rmdir()
        return str(path)

    return write, calls


def test_write_into_moves_the_write_into_the_holder(tmp_path):
    staging, holder = tmp_path / ".reverb", tmp_path / "holder"
    staging.mkdir()
    holder.mkdir()
    write, calls = staged_writer(staging)
    assert write_into(str(holder), str(staging), write) == str(holder / DATA_DIR)
    assert (holder / DATA_DIR / "DONE").exists() and os.listdir(staging) == []
    assert len(calls) == 1


def test_a_write_deleted_before_it_moved_is_written_again_up_to_writes(tmp_path, caplog):
    staging, holder = tmp_path / ".reverb", tmp_path / "holder"
    staging.mkdir()
    holder.mkdir()
    write, calls = staged_writer(staging, deleted_first=WRITES - 1)
    with caplog.at_level(logging.WARNING, logger=snapshots.__name__):
        assert write_into(str(holder), str(staging), write) == str(holder / DATA_DIR)
    assert len(calls) == WRITES
    assert sum("was deleted by another save" in r.getMessage() for r in caplog.records) == 2
    (holder / DATA_DIR / "DONE").unlink()
    (holder / DATA_DIR).rmdir()
    write, calls = staged_writer(staging, deleted_first=WRITES)
    with pytest.raises(CheckpointError, match=f"each of {WRITES} snapshots was deleted"):
        write_into(str(holder), str(staging), write)
    assert len(calls) == WRITES


def test_a_write_that_cannot_be_moved_is_removed_and_named(tmp_path):
    staging, holder = tmp_path / ".reverb", tmp_path / "holder"
    staging.mkdir()
    (holder / DATA_DIR).mkdir(parents=True)
    (holder / DATA_DIR / "in-the-way").write_text("")  # a non-empty target: rename fails
    write, calls = staged_writer(staging)
    with pytest.raises(CheckpointError, match=r"^cannot move snapshot '.*written-1' to '.*"):
        write_into(str(holder), str(staging), write)
    assert os.listdir(staging) == [] and len(calls) == 1


@pytest.mark.parametrize(
    "name",
    [
        f"snapshot--{TOKEN}",
        f"snapshot-12-{TOKEN[:-1]}",
        f"snapshot-12-{TOKEN.upper()}",
        f"snapshot-x1-{TOKEN}",
        f"snap-12-{TOKEN}",
        f"snapshot-12-{TOKEN}-more",
    ],
)
def test_a_name_not_made_by_new_snapshot_dir_is_never_a_snapshot(tmp_path, name):
    path = own(tmp_path, name, {"format": FORMAT})
    assert not is_own_snapshot(str(path), name)


def test_only_a_marked_directory_or_one_killed_before_its_marker_is_a_snapshot(tmp_path):
    name = f"{PREFIX}12-{TOKEN}"
    path = own(tmp_path, name)
    assert is_own_snapshot(str(path), name)  # killed right after mkdir
    (path / f"{MARKER_FILE}.tmp").write_text("{")
    assert is_own_snapshot(str(path), name)  # ... or while writing the marker
    (path / "data").write_text("")
    assert not is_own_snapshot(str(path), name)
    (path / "data").unlink()
    (path / MARKER_FILE).write_text(json.dumps({"format": "other/1"}))
    assert not is_own_snapshot(str(path), name)
    (path / MARKER_FILE).write_text("not json")
    assert not is_own_snapshot(str(path), name)
    (path / MARKER_FILE).write_text(json.dumps({"format": FORMAT}))
    assert is_own_snapshot(str(path), name)


def test_links_files_and_special_markers_are_never_snapshots(tmp_path):
    name = f"{PREFIX}12-{TOKEN}"
    target = own(tmp_path, "target", {"format": FORMAT})
    (tmp_path / name).symlink_to(target)
    assert not is_own_snapshot(str(tmp_path / name), name)
    (tmp_path / name).unlink()
    (tmp_path / name).write_text("")
    assert not is_own_snapshot(str(tmp_path / name), name)
    (tmp_path / name).unlink()
    path = own(tmp_path, name)
    os.mkfifo(path / MARKER_FILE)
    assert not is_own_snapshot(str(path), name)  # and the pipe is not opened
    (path / f"{MARKER_FILE}.tmp").symlink_to(target)
    assert not is_own_snapshot(str(path), name)


def test_remove_stale_deletes_snapshots_and_leaves_the_rest_with_a_warning(tmp_path, caplog):
    root = tmp_path / ".snapshots"
    assert remove_stale(str(root)) == []
    root.mkdir()
    snapshot = own(root, marker={"format": FORMAT})
    (snapshot / DATA_DIR).mkdir()
    stranger = own(root, "keep-me")
    with caplog.at_level(logging.WARNING, logger=snapshots.__name__):
        assert remove_stale(str(root)) == [str(snapshot)]
    assert os.listdir(root) == ["keep-me"] and stranger.exists()
    assert any("is not a replay_service snapshot" in r.getMessage() for r in caplog.records)
