"""Copying a buffer for training (`copy_buffer`): only its newest checkpoint, never half-written,
never over foreign files or a buffer in use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import collect, tree_digest
from replay_service import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointStore,
    NoCheckpointError,
    SpecMismatchError,
)
from replay_service.starter import copy_buffer
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    REVERB_DIR,
    STORE_FILE,
)


@pytest.fixture()
def source(make_manager, env, policy, tmp_path) -> tuple[Path, int]:
    """A checkpoint directory with three checkpoints (20, 40, 60 steps); returns it and the
    newest checkpoint's item count."""
    manager = make_manager(checkpoint_dir=str(tmp_path / "source"), keep_checkpoints=3)
    _, observer = manager.create_replay_buffer()
    for _ in range(3):
        collect(env, policy, observer, 20)
        manager.checkpoint()
    count = manager.num_frames()
    manager.close()
    return tmp_path / "source", count


def loaded_count(make_manager, path: Path) -> int:
    manager = make_manager(checkpoint_dir=str(path))
    manager.load_replay_buffer()
    count = manager.num_frames()
    manager.close()
    return count


def test_the_copy_holds_only_the_newest_checkpoint_and_loads(source, make_manager, tmp_path):
    source_dir, count = source
    newest = CheckpointStore(source_dir).latest()
    assert newest is not None and newest.sequence == 3
    target = tmp_path / "run" / "replay"
    assert copy_buffer(source_dir, target) == str(target)

    assert sorted(os.listdir(target)) == sorted([STORE_FILE, CHECKPOINTS_DIR, REVERB_DIR])
    assert os.listdir(target / REVERB_DIR) == []
    [name] = os.listdir(target / CHECKPOINTS_DIR)
    assert name == f"{CHECKPOINT_PREFIX}00000001"
    copied = target / CHECKPOINTS_DIR / name
    original, duplicate = tree_digest(Path(newest.path)), tree_digest(copied)
    assert original.pop(CHECKPOINT_META_FILE) != duplicate.pop(CHECKPOINT_META_FILE)
    assert duplicate == original
    info = json.loads((copied / CHECKPOINT_META_FILE).read_text())
    assert info["sequence"] == 1
    assert info["copied_from"] == {"path": newest.path, "sequence": 3}
    assert info["num_items"] == count
    assert (target / STORE_FILE).read_bytes() == (source_dir / STORE_FILE).read_bytes()
    assert sorted(os.listdir(tmp_path / "run")) == ["replay"]

    assert loaded_count(make_manager, target) == count


def test_a_data_spec_given_for_a_copy_is_checked_against_the_buffer(source, data_spec, tmp_path):
    source_dir, count = source
    before = tree_digest(source_dir)
    wrong = data_spec._replace(reward=tf.TensorSpec([2], tf.float32, "reward"))
    with pytest.raises(SpecMismatchError, match=r"field 'reward': expected float32\[2\]"):
        copy_buffer(source_dir, tmp_path / "copy", data_spec=wrong)
    assert not (tmp_path / "copy").exists()
    copy_buffer(source_dir, tmp_path / "copy", data_spec=data_spec)
    assert CheckpointStore(tmp_path / "copy").latest().num_items == count
    assert tree_digest(source_dir) == before


@pytest.mark.heavy
def test_training_on_the_copy_leaves_the_source_unchanged(
    source, make_manager, env, policy, tmp_path
):
    source_dir, count = source
    before = tree_digest(source_dir)
    target = tmp_path / "train"
    copy_buffer(source_dir, target)

    manager = make_manager(checkpoint_dir=str(target))
    _, observer = manager.load_replay_buffer()
    collect(env, policy, observer, 40)
    grown = manager.num_frames()
    assert grown > count
    manager.checkpoint()
    manager.checkpoint()
    manager.close()

    assert tree_digest(source_dir) == before
    assert loaded_count(make_manager, target) == grown
    assert loaded_count(make_manager, source_dir) == count


def test_a_non_empty_target_is_refused_and_a_foreign_one_never_replaced(source, tmp_path):
    source_dir, _ = source
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=f"copy target '{target}' is not empty"):
        copy_buffer(source_dir, target)
    with pytest.raises(CheckpointError, match=r"never replaced .*") as raised:
        copy_buffer(source_dir, target, overwrite=True)
    assert "notes.txt" in str(raised.value)
    assert os.listdir(target) == ["notes.txt"]
    assert (target / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_buffer_in_the_target(source, make_manager, env, policy, tmp_path):
    source_dir, count = source
    target = tmp_path / "target"
    other = make_manager(checkpoint_dir=str(tmp_path / "other"))
    _, observer = other.create_replay_buffer()
    collect(env, policy, observer, 5)
    other.checkpoint()
    other_count = other.num_frames()
    other.close()
    assert other_count != count

    copy_buffer(tmp_path / "other", target)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        copy_buffer(source_dir, target)
    assert loaded_count(make_manager, target) == other_count
    copy_buffer(source_dir, target, overwrite=True)
    assert loaded_count(make_manager, target) == count
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]


def test_an_empty_target_directory_is_used(source, make_manager, tmp_path):
    source_dir, count = source
    (tmp_path / "empty").mkdir()
    copy_buffer(source_dir, tmp_path / "empty")
    assert loaded_count(make_manager, tmp_path / "empty") == count


def test_a_target_in_use_is_not_replaced(source, make_manager, tmp_path):
    source_dir, count = source
    target = tmp_path / "target"
    copy_buffer(source_dir, target)
    manager = make_manager(checkpoint_dir=str(target))
    manager.load_replay_buffer()
    with pytest.raises(CheckpointError, match="in use"):
        copy_buffer(source_dir, target, overwrite=True)
    assert manager.num_frames() == count


def test_sources_that_are_not_complete_buffers_are_refused(make_manager, tmp_path):
    target = tmp_path / "target"
    with pytest.raises(NoCheckpointError, match="does not exist"):
        copy_buffer(tmp_path / "missing", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointError, match="is empty"):
        copy_buffer(tmp_path / "empty", target)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.csv").write_text("1,2")
    with pytest.raises(CheckpointError, match="not a replay_service checkpoint directory"):
        copy_buffer(tmp_path / "foreign", target)
    make_manager(checkpoint_dir=str(tmp_path / "unsaved")).create_replay_buffer()
    with pytest.raises(NoCheckpointError, match="holds no complete checkpoint to copy"):
        copy_buffer(tmp_path / "unsaved", target)
    assert not target.exists()


def test_overlapping_paths_are_refused(source, tmp_path):
    source_dir, _ = source
    before = tree_digest(source_dir)
    for target in (source_dir, source_dir / "inside", tmp_path):
        with pytest.raises(CheckpointError, match="overlap"):
            copy_buffer(source_dir, target, overwrite=True)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        copy_buffer(source_dir, tmp_path / "a_file")
    assert tree_digest(source_dir) == before
