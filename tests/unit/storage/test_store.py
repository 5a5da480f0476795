"""The checkpoint store's own logic, on a real directory, with a small checkpoint format of the
test's own (`ToyFormat`): what the store records and compares, how it stages, commits, retains,
quarantines and refuses, and what it leaves alone. No backend is involved."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

from replay_service.errors import (
    BackendMismatchError,
    CheckpointError,
    CheckpointExistsError,
    NoCheckpointError,
    UnknownFormatError,
)
from replay_service.storage.checkpoint_format import Verified
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CORRUPT_DIR,
    REVERB_DIR,
    SNAPSHOTS_DIR,
    STORE_FILE,
)
from replay_service.storage.files import DONE_FILE, file_digest
from replay_service.storage.metadata import (
    FORMAT,
    Checkpoint,
)
from replay_service.storage.store import CheckpointStore
from storage_fakes import metadata

pytestmark = pytest.mark.local

DATA_FILE = "items.toy"
NEWER = FORMAT.rsplit("/", 1)[0] + "/99"
"""The store file's format tag of a future release."""


class ToyFormat:
    """A checkpoint format of one text file, one line per item: owned by its `.toy` file,
    damaged when its last line is cut."""

    def __init__(self, backend: str = "toy") -> None:
        self.backend = backend
        self.settle_s = 0.0

    def owns(self, names: Collection[str]) -> bool:
        return any(n.endswith(".toy") for n in names)

    def verify(self, path: str) -> Verified:
        if not os.path.isfile(os.path.join(path, DONE_FILE)):
            raise CheckpointError(f"toy checkpoint {path!r} has no {DONE_FILE}")
        data = Path(path, DATA_FILE).read_text()
        if data and not data.endswith("\n"):
            raise CheckpointError(f"{path!r}/{DATA_FILE} is truncated")
        return data.count("\n"), {DATA_FILE: file_digest(os.path.join(path, DATA_FILE))}


TOY = ToyFormat()


def toy_writer(items: int, name: str = "written", done: bool = True) -> Any:
    """A checkpoint writer as a backend hands `commit`: it writes into the staging root and
    leaves the read-back to the store."""

    def write(staging_root: str) -> tuple[str, None]:
        path = os.path.join(staging_root, name)
        os.makedirs(path)
        Path(path, DATA_FILE).write_text("".join(f"item {i}\n" for i in range(items)))
        if done:
            Path(path, DONE_FILE).write_text("")
        return path, None

    return write


@pytest.fixture()
def store(tmp_path: Path) -> CheckpointStore:
    """A new, locked buffer directory that knows the toy format, keeping 2 checkpoints."""
    store = CheckpointStore(tmp_path / "ckpt", keep=2, formats=(TOY,))
    store.lock()
    store.prepare_new(metadata())
    yield store
    store.unlock()


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")


# -------------------------------------------------------------------- staging and commit


def test_commit_verifies_records_and_adopts_what_the_writer_staged(store):
    checkpoint = store.commit(metadata(), toy_writer(3))
    assert checkpoint.sequence == 1
    assert checkpoint.path == os.path.join(store.checkpoints_dir, "ckpt-00000001")
    assert checkpoint.num_items == 3 and checkpoint.backend == "toy"
    assert checkpoint.metadata == metadata()
    assert checkpoint.files == {DATA_FILE: file_digest(os.path.join(checkpoint.path, DATA_FILE))}
    recorded = json.loads(Path(checkpoint.path, CHECKPOINT_META_FILE).read_text())
    assert recorded["backend"] == "toy" and recorded["reverb_name"] == "written"
    assert os.listdir(store.reverb_root) == []
    assert store.latest() == checkpoint
    assert store.commit(metadata(), toy_writer(4)).sequence == 2


def test_a_damaged_write_is_discarded_and_nothing_is_adopted(store):
    def cut(staging_root: str) -> tuple[str, None]:
        path, _ = toy_writer(2)(staging_root)
        with open(os.path.join(path, DATA_FILE), "a") as f:
            f.write("half an item")
        return path, None

    with pytest.raises(CheckpointError, match="truncated.*still holds its items$"):
        store.commit(metadata(), cut)
    assert store.entries() == [] and os.listdir(store.reverb_root) == []


def test_a_store_that_knows_no_format_of_the_files_cannot_adopt_them(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", formats=())
    store.prepare_new(metadata())
    with pytest.raises(CheckpointError, match=r"no files of a known checkpoint format"):
        store.commit(metadata(), toy_writer(1))
    assert store.entries() == []


def test_retention_keeps_the_newest_verified_checkpoints(store):
    paths = [store.commit(metadata(), toy_writer(i)).path for i in range(4)]
    assert [path for _, path in store.entries()] == paths[-2:]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])


def test_staged_checkpoints_are_adopted_and_damaged_ones_moved_aside(store):
    toy_writer(2, "first")(store.reverb_root)
    toy_writer(1, "partial", done=False)(store.reverb_root)  # a write that never finished
    damaged, _ = toy_writer(1, "second")(store.reverb_root)
    Path(damaged, DATA_FILE).write_text("cut")
    assert store.staged() == [os.path.join(store.reverb_root, n) for n in ("first", "second")]
    adopted = store.clean_staging(metadata())
    assert [(c.sequence, c.num_items) for c in adopted] == [(1, 2)]
    assert os.listdir(store.reverb_root) == []
    corrupt = os.listdir(os.path.join(store.root, CORRUPT_DIR))
    assert len(corrupt) == 1 and corrupt[0].startswith("second-")


# ---------------------------------------------------------------- restore and quarantine


def test_a_checkpoint_that_fails_to_load_is_moved_aside_and_the_previous_one_loads(store):
    first = store.commit(metadata(), toy_writer(1))
    second = store.commit(metadata(), toy_writer(2))
    tried: list[int] = []
    discarded: list[bool] = []

    def load(checkpoint: Checkpoint) -> None:
        tried.append(checkpoint.sequence)
        if checkpoint.sequence == second.sequence:
            raise CheckpointError("fewer items restored than recorded")

    loaded = store.restore_latest(metadata(), load, lambda: discarded.append(True), backend="toy")
    assert loaded == first and tried == [2, 1] and discarded == [True]
    assert [path for _, path in store.entries()] == [first.path]
    (moved,) = os.listdir(os.path.join(store.root, CORRUPT_DIR))
    assert moved.startswith("ckpt-00000002-")


def test_a_checkpoint_of_an_unknown_format_is_refused_and_nothing_moves(store, tmp_path):
    checkpoint = store.commit(metadata(), toy_writer(1))
    meta = Path(checkpoint.path, CHECKPOINT_META_FILE)
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": NEWER}))
    before = tree(tmp_path)
    with pytest.raises(UnknownFormatError):
        store.restore_latest(metadata(), lambda c: None, lambda: None, backend="toy")
    assert tree(tmp_path) == before


def test_another_backends_checkpoint_is_refused_by_name_and_nothing_moves(store, tmp_path):
    checkpoint = store.commit(metadata(), toy_writer(1))
    meta = Path(checkpoint.path, CHECKPOINT_META_FILE)
    info = json.loads(meta.read_text())
    del info["backend"]  # as written before the field existed: known by its files
    meta.write_text(json.dumps(info))
    before = tree(tmp_path)
    two = CheckpointStore(store.root, formats=(ToyFormat("other"), TOY))
    assert two.latest().backend == "other"  # the first format that owns the files
    with pytest.raises(BackendMismatchError, match="written by the 'toy' backend"):
        store.check_backend("local")
    with pytest.raises(BackendMismatchError, match="backend='local', which cannot read it"):
        store.restore_newest(lambda c: None, lambda: None, backend="local")
    assert tree(tmp_path) == before
    assert CheckpointStore(store.root, formats=()).latest().backend is None


def test_a_directory_whose_checkpoints_all_failed_is_not_empty(store):
    store.commit(metadata(), toy_writer(1))

    def damaged(checkpoint: Checkpoint) -> None:
        raise CheckpointError("damaged")

    with pytest.raises(NoCheckpointError, match="moved aside as damaged"):
        store.restore_newest(damaged, lambda: None, backend="toy")
    assert store.entries() == [] and len(store.quarantined()) == 1
    assert store.has_checkpoints()
    with pytest.raises(CheckpointExistsError, match="only checkpoints that failed to restore"):
        store.check_new()


# ------------------------------------------------------------- what the store leaves alone


def test_foreign_entries_are_never_touched(store, tmp_path):
    notes = Path(store.checkpoints_dir, "notes.txt")
    notes.write_text("mine")
    odd = Path(store.checkpoints_dir, "ckpt-latest")
    odd.mkdir()
    for i in range(3):
        store.commit(metadata(), toy_writer(i))
    store.prepare_new(metadata(), overwrite=True)
    assert store.entries() == []
    assert notes.read_text() == "mine" and odd.is_dir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    Path(foreign, "data.bin").write_text("x")
    with pytest.raises(CheckpointError, match=rf"no {STORE_FILE}\); it contains: data.bin"):
        CheckpointStore(foreign, formats=(TOY,)).check_new(overwrite=True)
    assert os.listdir(foreign) == ["data.bin"]


def test_snapshots_are_read_outside_checkpoints_and_never_listed(store):
    kept = store.commit(metadata(), toy_writer(1))
    seen: dict[str, Any] = {}

    def read(path: str) -> int:
        seen["path"] = path
        seen["listed"] = [c.path for c in store.checkpoints()]
        seen["staged"] = store.staged()
        return Path(path, DATA_FILE).read_text().count("\n")

    assert store.snapshot(metadata(), toy_writer(5, "snap"), read) == 5
    assert Path(seen["path"]).parent.parent == Path(store.root, SNAPSHOTS_DIR)
    assert seen["listed"] == [kept.path] and seen["staged"] == []
    assert store.checkpoints() == [kept] and os.listdir(store.snapshots_dir) == []

    left = Path(store.snapshots_dir, f"snapshot-{os.getpid()}-{'0' * 32}")
    left.mkdir()
    Path(left, "replay_service_snapshot.json").write_text(
        json.dumps({"format": "replay_service.snapshot/1"})
    )
    stranger = Path(store.snapshots_dir, "keep-me")
    stranger.mkdir()
    assert store.clean_snapshots() == [str(left)]
    assert os.listdir(store.snapshots_dir) == ["keep-me"]
    assert store.checkpoints() == [kept]


def test_a_linked_own_directory_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / REVERB_DIR)
    store = CheckpointStore(root, formats=(TOY,))
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        store.lock()
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(root)) == [".lock", REVERB_DIR]
    assert not (root / CHECKPOINTS_DIR).exists()
