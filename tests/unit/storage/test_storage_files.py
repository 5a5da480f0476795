"""`storage.files`: a checkpoint's DONE marker, file digests checked against the record, and
listing and deleting what the store owns."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from replay_service.errors import CheckpointError, NotRegularFileError
from replay_service.storage import files
from replay_service.storage.files import (
    DONE_FILE,
    check_recorded_files,
    file_digest,
    file_sha256,
    is_done,
    is_settled,
    link_or_copy,
    list_dir,
    remove_path,
)


def test_a_checkpoint_is_done_once_its_done_file_is_there(tmp_path):
    assert not is_done(str(tmp_path))
    assert not is_done(str(tmp_path / "missing"))
    (tmp_path / DONE_FILE).write_text("")
    assert is_done(str(tmp_path))
    os.remove(tmp_path / DONE_FILE)
    os.mkfifo(tmp_path / DONE_FILE)
    with pytest.raises(NotRegularFileError, match="DONE' is a named pipe"):
        is_done(str(tmp_path))


def test_settled_counts_from_when_done_was_written(tmp_path):
    assert not is_settled(str(tmp_path), 0)
    (tmp_path / DONE_FILE).write_text("")
    assert is_settled(str(tmp_path), 0)
    assert not is_settled(str(tmp_path), 60)
    old = time.time() - 120
    os.utime(tmp_path / DONE_FILE, (old, old))
    assert is_settled(str(tmp_path), 60)


def test_digests_read_the_file_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_READ_BLOCK", 7)
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(str(tmp_path / "f")) == hashlib.sha256(data).hexdigest()
    assert file_digest(str(tmp_path / "f")) == {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    with pytest.raises(CheckpointError, match=r"^cannot read '.*missing': "):
        file_digest(str(tmp_path / "missing"))


@pytest.fixture()
def recorded(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"")
    return {name: file_digest(str(tmp_path / name)) for name in ("a", "b")}


def test_recorded_files_that_match_pass(tmp_path, recorded):
    check_recorded_files(str(tmp_path), recorded, ["a", "b"])
    check_recorded_files(str(tmp_path), recorded, [])


def test_a_file_of_another_size_or_content_is_named(tmp_path, recorded):
    (tmp_path / "a").write_bytes(b"abcd")
    with pytest.raises(CheckpointError) as raised:
        check_recorded_files(str(tmp_path), recorded, ["a"])
    assert str(raised.value) == (
        f"{str(tmp_path / 'a')!r} has 4 bytes, but 3 were recorded when the checkpoint was taken"
    )
    (tmp_path / "a").write_bytes(b"abd")
    with pytest.raises(CheckpointError, match=r"'.*a' is damaged: SHA-256 [0-9a-f]{64}, recorded"):
        check_recorded_files(str(tmp_path), recorded, ["a"])


def test_a_missing_unrecorded_or_special_file_is_named(tmp_path, recorded):
    with pytest.raises(CheckpointError, match=r"records no checksum of c$"):
        check_recorded_files(str(tmp_path), recorded, ["c"])
    os.remove(tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"^cannot read '.*b': .*No such file"):
        check_recorded_files(str(tmp_path), recorded, ["b"])
    os.mkfifo(tmp_path / "b")
    with pytest.raises(NotRegularFileError, match="is a named pipe"):
        check_recorded_files(str(tmp_path), recorded, ["b"])


def test_link_or_copy_links_else_copies_with_times(tmp_path, monkeypatch):
    (tmp_path / "src").write_text("data")
    link_or_copy(str(tmp_path / "src"), str(tmp_path / "linked"))
    assert os.path.samefile(tmp_path / "src", tmp_path / "linked")

    def no_link(source, target):
        raise OSError("cross-device link")

    monkeypatch.setattr(files.os, "link", no_link)
    old = time.time() - 1000
    os.utime(tmp_path / "src", (old, old))
    link_or_copy(str(tmp_path / "src"), str(tmp_path / "copied"))
    assert not os.path.samefile(tmp_path / "src", tmp_path / "copied")
    assert (tmp_path / "copied").read_text() == "data"
    assert os.stat(tmp_path / "copied").st_mtime == pytest.approx(old, abs=1)


def test_list_dir_is_empty_for_nothing_and_names_a_looping_link(tmp_path):
    (tmp_path / "f").write_text("")
    assert list_dir(str(tmp_path)) == ["f"]
    assert list_dir(str(tmp_path / "missing")) == []
    assert list_dir(str(tmp_path / "f")) == []
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointError, match=r"^cannot list '.*loop': "):
        list_dir(str(tmp_path / "loop"))


def test_remove_path_deletes_trees_files_and_links_never_their_targets(tmp_path):
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "keep").write_text("")
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    remove_path(str(tmp_path / "link"))
    assert not (tmp_path / "link").exists() and (target / "sub" / "keep").exists()
    remove_path(str(target))
    assert not target.exists()
    (tmp_path / "file").write_text("")
    remove_path(str(tmp_path / "file"))
    remove_path(str(tmp_path / "file"))  # gone: no error
    assert os.listdir(tmp_path) == []
