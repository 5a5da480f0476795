"""`storage.file_modes`: explicit permissions, regular files only, and durable writes."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from replay_service.errors import NotRegularFileError
from replay_service.storage.file_modes import (
    DIR_MODE,
    FILE_MODE,
    file_kind,
    fsync_tree,
    make_dirs,
    open_private,
    open_regular,
    regular_file_exists,
    restrict_tree,
    write_json_atomic,
    write_synced,
)


@pytest.fixture()
def umask_000():
    """Runs the test under umask 000, where files would otherwise be world-writable."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_write_json_atomic_replaces_the_file_or_leaves_it_as_it_was(tmp_path):
    path = str(tmp_path / "meta.json")
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert json.loads(Path(path).read_text(encoding="utf-8")) == {"a": [1, 2], "b": 1}
    assert stat.S_IMODE(os.stat(path).st_mode) == FILE_MODE
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(Path(path).read_text(encoding="utf-8")) == {"a": [1, 2], "b": 1}
    assert sorted(os.listdir(tmp_path)) == ["meta.json"], "the temporary file is removed"


def test_write_synced_and_fsync_tree(tmp_path):
    (tmp_path / "sub").mkdir()
    path = str(tmp_path / "sub" / "DONE")
    write_synced(path, "done\n")
    assert Path(path).read_text(encoding="utf-8") == "done\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == FILE_MODE
    fsync_tree(str(tmp_path))  # every file and directory opens and syncs
    with pytest.raises(OSError):
        write_synced(str(tmp_path / "missing" / "DONE"), "")


def test_file_kind_names_every_kind_of_entry(tmp_path):
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    kinds = {name: file_kind(os.lstat(tmp_path / name).st_mode) for name in os.listdir(tmp_path)}
    assert kinds == {
        "file": "a regular file",
        "fifo": "a named pipe (FIFO)",
        "link": "a symbolic link",
    }
    assert file_kind(stat.S_IFDIR) == "a directory"
    assert file_kind(stat.S_IFSOCK) == "a socket"
    assert file_kind(stat.S_IFCHR) == "a character device"
    assert file_kind(stat.S_IFBLK) == "a block device"
    assert file_kind(0o170000) == "a special file (mode 170000)"


def test_regular_file_exists_is_false_for_nothing_and_refuses_other_kinds(tmp_path):
    (tmp_path / "file").write_text("x")
    assert regular_file_exists(str(tmp_path / "file")) is True
    assert regular_file_exists(str(tmp_path / "missing")) is False
    assert regular_file_exists(str(tmp_path / "file" / "below")) is False  # parent is a file
    (tmp_path / "sub").mkdir()
    with pytest.raises(NotRegularFileError, match=r"'.*sub' is a directory, not a regular file"):
        regular_file_exists(str(tmp_path / "sub"))


def test_a_socket_is_named_and_left_in_place(tmp_path):
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(NotRegularFileError) as raised:
            open_regular(str(path))
    message = str(raised.value)
    assert f"{str(path)!r} is a socket, not a regular file" in message
    assert f"move it out of {str(tmp_path)!r}" in message
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_open_regular_reads_a_file_and_never_opens_a_pipe_or_link(tmp_path):
    (tmp_path / "data").write_text("contents", encoding="utf-8")
    with open_regular(str(tmp_path / "data"), "r", encoding="utf-8") as f:
        assert f.read() == "contents"
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would block forever
    with pytest.raises(NotRegularFileError, match="is a named pipe"):
        open_regular(str(tmp_path / "fifo"))
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(NotRegularFileError, match="is a symbolic link"):
        open_regular(str(tmp_path / "link"), "rb")
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="open_regular reads only .*got mode 'w'"):
        open_regular(str(tmp_path / "data"), "w")


def test_open_private_sets_file_mode_even_on_an_existing_file(tmp_path, umask_000):
    path = tmp_path / "out"
    path.write_text("old")
    os.chmod(path, 0o666)
    with open_private(str(path), "w", encoding="utf-8") as f:
        f.write("new")
    assert path.read_text() == "new"
    assert mode_of(path) == FILE_MODE
    with open_private(str(tmp_path / "fresh"), "wb") as f:
        f.write(b"\0")
    assert mode_of(tmp_path / "fresh") == FILE_MODE


def test_open_private_neither_follows_nor_changes_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(NotRegularFileError, match="'.*link' is a symbolic link"):
        open_private(str(tmp_path / "link"))
    assert target.read_text() == "keep"
    assert (tmp_path / "link").is_symlink()


def test_write_json_atomic_leaves_a_non_regular_target_or_temporary_file_alone(tmp_path):
    path = tmp_path / "meta.json"
    os.mkfifo(path)
    with pytest.raises(NotRegularFileError, match="meta.json' is a named pipe"):
        write_json_atomic(str(path), {"a": 1})
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    os.remove(path)
    tmp = tmp_path / "meta.json.tmp"
    os.mkfifo(tmp)
    with pytest.raises(NotRegularFileError, match=r"meta\.json\.tmp' is a named pipe"):
        write_json_atomic(str(path), {"a": 1})
    assert stat.S_ISFIFO(os.lstat(tmp).st_mode), "the pipe is never removed"
    assert not path.exists()


def test_make_dirs_creates_parents_with_dir_mode_and_keeps_an_existing_mode(tmp_path, umask_000):
    os.chmod(tmp_path, 0o755)
    make_dirs(str(tmp_path / "a" / "b" / "c"))
    for part in ("a", "a/b", "a/b/c"):
        assert mode_of(tmp_path / part) == DIR_MODE, part
    assert mode_of(tmp_path) == 0o755
    (tmp_path / "mine").mkdir(mode=0o700)
    make_dirs(str(tmp_path / "mine"))
    assert mode_of(tmp_path / "mine") == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        make_dirs(str(tmp_path / "file"))
    with pytest.raises(OSError):
        make_dirs(str(tmp_path / "file" / "below"))


def test_restrict_tree_sets_modes_below_and_leaves_links_and_their_targets(tmp_path, umask_000):
    outside = tmp_path / "outside"
    outside.write_text("")
    os.chmod(outside, 0o666)
    root = tmp_path / "ckpt"
    (root / "tables").mkdir(parents=True)
    (root / "tables" / "t.tfrecord").write_text("")
    os.chmod(root / "tables" / "t.tfrecord", 0o777)
    os.chmod(root / "tables", 0o777)
    (root / "link").symlink_to(outside)
    (tmp_path / "rootlink").symlink_to(root)
    restrict_tree(str(tmp_path / "rootlink"))  # a link as the root: nothing changes
    assert mode_of(root / "tables") == 0o777
    restrict_tree(str(root))
    assert mode_of(root) == DIR_MODE
    assert mode_of(root / "tables") == DIR_MODE
    assert mode_of(root / "tables" / "t.tfrecord") == FILE_MODE
    assert mode_of(outside) == 0o666


def test_fsync_tree_skips_pipes_and_links_without_opening_them(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it would block
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    fsync_tree(str(tmp_path))  # returns: the pipe is not opened, the link not followed
