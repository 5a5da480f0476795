"""The checkpoint steps both backends share, on the real store of a running buffer.

`CheckpointStore.commit` (write into the staging root, verify, adopt, retain) and
`CheckpointSchedule` (one checkpoint at a time, the last one recorded, the periodic thread) are
driven with writers that copy a checkpoint the buffer itself just took, on Reverb and on the
local backend: a write that fails leaves the staging root empty, an adopt that fails removes
what was written, and the buffer keeps its items and checkpoints on.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import wait_for
from replay_service import CheckpointError, ReplayBufferManager
from replay_service.storage.directory import CHECKPOINT_META_FILE
from replay_service.storage.metadata import Checkpoint
from replay_service.storage.schedule import CheckpointSchedule
from replay_service.storage.store import CheckpointStore

BACKENDS = ("reverb", "local")
STEP = np.array([0, 1, 0, 0], np.float32)
ITEMS = 5
KEPT = "the checkpoint was discarded and the buffer still holds its items"


@pytest.fixture(params=BACKENDS)
def buffer(make_manager, request, tmp_path) -> tuple[ReplayBufferManager, CheckpointStore]:
    """A running buffer of the parametrized backend holding `ITEMS` items in one checkpoint,
    and a second `CheckpointStore` object on its (locked) directory."""
    root = tmp_path / "ckpt"
    manager = make_manager(backend=request.param, checkpoint_dir=str(root), capacity=100)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for i in range(ITEMS):
        writer.add(STEP * i, i % 2, float(i), STEP * (i + 1), i == ITEMS - 1)
    writer.flush()
    manager.checkpoint()
    return manager, CheckpointStore(str(root), keep=10)


def copier(source: Checkpoint, damage: bool = False) -> Any:
    """A writer that copies `source`'s files (not its recorded metadata) into the staging root,
    as a backend's writer leaves a new checkpoint there; `damage` truncates its largest file."""

    def write(staging_root: str) -> tuple[str, None]:
        path = os.path.join(staging_root, "copied")
        shutil.copytree(source.path, path, ignore=shutil.ignore_patterns(CHECKPOINT_META_FILE))
        if damage:
            largest = max(Path(path).iterdir(), key=lambda p: p.stat().st_size)
            os.truncate(largest, largest.stat().st_size // 2)
        return path, None

    return write


def test_commit_adopts_what_the_writer_leaves_in_staging(buffer):
    manager, store = buffer
    metadata = store.read_metadata()
    source = store.latest()
    checkpoint = store.commit(metadata, copier(source))
    assert checkpoint.sequence == source.sequence + 1
    assert checkpoint.num_items == source.num_items == ITEMS
    assert checkpoint.files == source.files
    assert os.listdir(store.reverb_root) == []
    assert store.latest() == checkpoint
    assert manager.checkpoint().endswith(f"{checkpoint.sequence + 1:08d}")


def test_a_write_that_fails_leaves_staging_empty_and_names_the_staging_root(buffer):
    manager, store = buffer
    before = [path for _, path in store.entries()]
    frames = manager.num_frames()

    def write(staging_root: str) -> tuple[str, None]:
        partial = os.path.join(staging_root, "partial")
        os.mkdir(partial)
        Path(partial, "chunks.tfrecord").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError) as raised:
        store.commit(store.read_metadata(), write)
    assert str(raised.value) == (
        f"checkpoint into {store.reverb_root!r} failed: OSError: [Errno 28] No space left on device"
    )
    assert os.listdir(store.reverb_root) == []
    assert [path for _, path in store.entries()] == before
    assert manager.num_frames() == frames > 0
    manager.checkpoint()  # the buffer checkpoints on
    assert len(store.entries()) == len(before) + 1


def test_an_adopt_that_fails_removes_what_was_written(buffer):
    manager, store = buffer
    before = [path for _, path in store.entries()]
    frames = manager.num_frames()
    with pytest.raises(CheckpointError, match=f"{KEPT}$") as raised:
        store.commit(store.read_metadata(), copier(store.latest(), damage=True))
    assert os.path.join(store.reverb_root, "copied") in str(raised.value)
    assert os.listdir(store.reverb_root) == []
    assert [path for _, path in store.entries()] == before
    assert not os.path.exists(store.root + "/corrupt"), "nothing is moved aside: it was never kept"
    assert manager.num_frames() == frames > 0
    manager.checkpoint()
    assert len(store.entries()) == len(before) + 1


def test_the_schedule_records_checkpoints_and_survives_periodic_failures(buffer, caplog):
    manager, store = buffer
    log = logging.getLogger("test_checkpoint_steps")
    schedule = CheckpointSchedule(
        store, store.read_metadata(), log=log, thread_name="test-checkpoints"
    )
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise CheckpointError("disk full")

    with caplog.at_level(logging.ERROR, logger=log.name):
        schedule.start(failing, 0.05)
        wait_for(lambda: len(calls) >= 3, 10, "three periodic checkpoints")
        assert any(t.name == "test-checkpoints" for t in threading.enumerate())
        schedule.stop(timeout=10)
    assert not any(t.name == "test-checkpoints" for t in threading.enumerate())
    assert schedule.last_error == "CheckpointError: disk full"
    messages = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert "periodic checkpoint failed (will retry): CheckpointError: disk full" in messages

    checkpoint = schedule.checkpoint(copier(store.latest()))
    assert schedule.last_checkpoint == checkpoint
    assert schedule.last_checkpoint_duration_s is not None
    assert schedule.last_checkpoint_duration_s >= 0
    assert schedule.last_error is None
    assert manager.num_frames() > 0


def test_a_schedule_without_interval_or_adoption_starts_no_thread(buffer):
    _, store = buffer
    schedule = CheckpointSchedule(
        store, store.read_metadata(), log=logging.getLogger("x"), thread_name="idle-checkpoints"
    )
    schedule.start(lambda: None, None)
    assert not any(t.name == "idle-checkpoints" for t in threading.enumerate())
    schedule.stop(timeout=1)
