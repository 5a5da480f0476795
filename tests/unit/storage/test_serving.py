"""`storage.serving`: the lock one serving process holds on its checkpoint directory."""

from __future__ import annotations

import os
import shutil

import pytest

from replay_service.errors import CheckpointError, NotRegularFileError
from replay_service.storage.directory import LOCK_FILE, REVERB_DIR
from replay_service.storage.file_modes import FILE_MODE
from replay_service.storage.serving import (
    DirectoryLock,
    ServedDirectory,
    lock_holder,
    refuse_symlink,
)

pytestmark = pytest.mark.local


def test_a_held_lock_writes_the_pid_and_refuses_a_second_holder(tmp_path):
    first = DirectoryLock(str(tmp_path), str(tmp_path / LOCK_FILE))
    first.acquire(lambda: None)
    assert first.held and first.in_place()
    assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    assert os.stat(tmp_path / LOCK_FILE).st_mode & 0o777 == FILE_MODE
    first.acquire(lambda: pytest.fail("not checked again"))  # held: no-op
    second = DirectoryLock(str(tmp_path), str(tmp_path / LOCK_FILE))
    with pytest.raises(CheckpointError) as raised:
        second.acquire(lambda: None)
    assert str(raised.value) == (
        f"checkpoint_dir {str(tmp_path)!r} is in use by another buffer (lock held by pid "
        f"{os.getpid()}); close it first or choose another checkpoint_dir"
    )
    assert not second.held
    first.release()
    first.release()  # not held: no-op
    assert not first.held
    second.acquire(lambda: None)
    assert second.held
    second.release()


def test_a_failing_check_releases_the_lock_and_an_os_error_is_named(tmp_path):
    lock = DirectoryLock(str(tmp_path), str(tmp_path / LOCK_FILE))

    def check():
        raise PermissionError(13, "Permission denied", "x")

    with pytest.raises(CheckpointError, match=r"^cannot use checkpoint_dir '.*': .*Permission"):
        lock.acquire(check)
    assert not lock.held

    def refuse():
        raise CheckpointError("a link")

    with pytest.raises(CheckpointError, match="^a link$"):
        lock.acquire(refuse)
    lock.acquire(lambda: None)  # nobody else holds it
    lock.release()


def test_a_lock_file_that_is_a_link_or_a_pipe_is_refused_and_left(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    (tmp_path / LOCK_FILE).symlink_to(target)
    lock = DirectoryLock(str(tmp_path), str(tmp_path / LOCK_FILE))
    with pytest.raises(CheckpointError, match=r"\.lock' is a symbolic link; replay_service"):
        lock.acquire(lambda: None)
    assert target.read_text() == "keep" and (tmp_path / LOCK_FILE).is_symlink()
    (tmp_path / LOCK_FILE).unlink()
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(NotRegularFileError, match="is a named pipe"):
        refuse_symlink(str(tmp_path / LOCK_FILE))


def test_in_place_notices_the_directory_replaced_while_served(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = DirectoryLock(str(root), str(root / LOCK_FILE))
    lock.acquire(lambda: None)
    shutil.rmtree(root)
    assert not lock.in_place()
    root.mkdir()
    (root / LOCK_FILE).write_text("")
    assert not lock.in_place()
    lock.release()
    assert DirectoryLock(str(root), str(root / LOCK_FILE)).in_place()  # never locked


def test_lock_holder_reads_the_pid_or_says_unknown(tmp_path):
    assert lock_holder(str(tmp_path / "missing")) == "unknown"
    (tmp_path / "empty").write_text("  \n")
    assert lock_holder(str(tmp_path / "empty")) == "unknown"
    (tmp_path / "pid").write_text("4242\n")
    assert lock_holder(str(tmp_path / "pid")) == "4242"
    (tmp_path / "link").symlink_to(tmp_path / "pid")
    assert lock_holder(str(tmp_path / "link")) == "unknown"  # never followed


def test_a_served_directory_is_created_locked_and_unlocked(tmp_path):
    served = ServedDirectory(tmp_path / "new" / "ckpt")
    with served.locked():
        assert os.path.isdir(served.root) and os.path.exists(os.path.join(served.root, LOCK_FILE))
        with pytest.raises(CheckpointError, match="is in use by another buffer"):
            ServedDirectory(served.root).lock()
    with ServedDirectory(served.root).locked():
        pass


def test_serving_keeps_the_lock_on_success_and_cleans_up_on_failure(tmp_path):
    served = ServedDirectory(tmp_path)
    with served.serving():
        pass
    with pytest.raises(CheckpointError, match="in use"):
        ServedDirectory(tmp_path).lock()
    served.unlock()
    stopped = []
    with (
        pytest.raises(RuntimeError, match="start failed"),
        served.serving(lambda: stopped.append(1)),
    ):
        raise RuntimeError("start failed")
    assert stopped == [1]
    ServedDirectory(tmp_path).lock()  # released


def test_a_served_directory_with_a_linked_own_directory_is_not_locked(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / REVERB_DIR).symlink_to(tmp_path / "elsewhere")
    served = ServedDirectory(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        served.lock()
    other = ServedDirectory(tmp_path / "ckpt")
    (tmp_path / "ckpt" / REVERB_DIR).unlink()
    other.lock()  # the failed lock was released
    other.unlock()


def test_a_root_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"^cannot use checkpoint_dir '.*file/ckpt': "):
        ServedDirectory(tmp_path / "file" / "ckpt").lock()
