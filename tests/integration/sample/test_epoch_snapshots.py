"""`epoch_batches` next to checkpoints, failures and what a killed process left, both backends.

On embedded Reverb the pass reads a snapshot checkpoint (`CheckpointStore.snapshot`) kept in
its own `.snapshots/` directory; the local backend copies the items in memory. Checkpoints
taken while a pass reads (`manager.checkpoint()`, Reverb's `py_client.checkpoint()`) succeed,
the pass still sees every item once, and a pass that fails part-way leaves the buffer as it was.
(A process killed while it reads: tests/system/sample/test_epoch_crash.py.)
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import tree_digest
from replay_service import CheckpointError, CheckpointStore, ReplayBufferManager
from replay_service.backends.local.table import LocalTable
from replay_service.backends.reverb import transfer as export_lib
from replay_service.storage.directory import REVERB_DIR, SNAPSHOTS_DIR
from replay_service.storage.snapshots import FORMAT as SNAPSHOT_FORMAT
from replay_service.storage.snapshots import MARKER_FILE as SNAPSHOT_MARKER_FILE

pytestmark = pytest.mark.heavy

BACKENDS = ("reverb", "local")
JOIN_S = 60.0


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture()
def make(backend: str, make_from_spaces: Any) -> Callable[..., ReplayBufferManager]:
    """`from_spaces` managers of the parametrized backend (conftest's `make_from_spaces`)."""
    return functools.partial(make_from_spaces, backend)


def write(manager: ReplayBufferManager, episodes: int, first: int = 0) -> None:
    """`episodes` episodes of 5 transitions; the state of step i of episode e is `[e, i, 0, 0]`."""
    writer = manager.transition_writer()
    for episode in range(first, first + episodes):
        for i in range(5):
            state = np.array([episode, i, 0, 0], np.float32)
            writer.add(state, i % 2, 1.0, np.array([episode, i + 1, 0, 0], np.float32), i == 4)
    writer.flush()


def keys(manager: ReplayBufferManager, **kwargs: Any) -> list[tuple[int, int]]:
    """`(episode, index)` of the first step of every item of one `epoch_batches` epoch."""
    found = []
    for batch in manager.epoch_batches(4, seed=0, **kwargs):
        rows = batch.observation[:, 0, :2].numpy().astype(int)
        found += [(int(a), int(b)) for a, b in rows]
    return found


def during_read(monkeypatch: pytest.MonkeyPatch, backend: str, act: Callable[[], None]) -> None:
    """Runs `act()` while `epoch_batches` reads its items: on Reverb once the snapshot is
    written and is being read, on the local backend as the table's items are read. Only the
    first read acts (a local checkpoint reads the items too)."""
    acts = [act]

    def act_once() -> None:
        if acts:
            acts.pop()()

    if backend == "reverb":
        real = export_lib.read_items

        def read(handle: Any, path: str) -> Any:
            assert os.path.isdir(path), path
            act_once()
            return real(handle, path)

        monkeypatch.setattr(export_lib, "read_items", read)
    else:
        real_items = LocalTable.items

        def items(table: LocalTable, **kwargs: Any) -> Any:
            act_once()
            return real_items(table, **kwargs)

        monkeypatch.setattr(LocalTable, "items", items)


def in_thread(call: Callable[[], Any]) -> Callable[[], Any]:
    """Starts `call` in a thread; the returned function joins it (bounded) and returns its
    result or raises its error."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as e:  # handed to the joiner
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(JOIN_S)
        assert not thread.is_alive(), f"{call} did not finish within {JOIN_S} s"
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


def test_checkpoints_taken_while_epoch_batches_reads_succeed_and_restore(
    make, backend, monkeypatch
):
    manager = make(keep_checkpoints=2)
    manager.create_replay_buffer()
    write(manager, 3)  # 15 items
    expected = sorted((e, i) for e in range(3) for i in range(5))
    taken: dict[str, Any] = {}

    def checkpoint_now() -> None:
        if backend == "reverb":
            # Reverb's own client save: it deletes every older entry of Reverb's root.
            taken["client"] = manager.py_client.checkpoint()
        # The manager's checkpoint runs while the pass reads (it is not held up by it).
        taken["manager"] = in_thread(manager.checkpoint)()

    during_read(monkeypatch, backend, checkpoint_now)
    assert sorted(keys(manager)) == expected  # every item exactly once
    monkeypatch.undo()
    assert set(taken) == ({"client", "manager"} if backend == "reverb" else {"manager"})
    store = CheckpointStore(manager.checkpoint_dir)
    paths = [c.path for c in store.checkpoints()]
    assert paths[-1] == taken["manager"]
    assert all(c.num_items == 15 for c in store.checkpoints())
    snapshots = os.path.join(manager.checkpoint_dir, SNAPSHOTS_DIR)
    assert not os.path.isdir(snapshots) or os.listdir(snapshots) == []
    assert sorted(keys(manager)) == expected  # and again, with nothing in the way

    write(manager, 1, first=3)  # not checkpointed
    manager.close()
    again = make(keep_checkpoints=2)
    again.load_replay_buffer()
    assert len(again) == 15
    assert sorted(keys(again)) == expected


def test_a_failure_part_way_through_epoch_batches_leaves_the_buffer_as_it_was(
    make, backend, monkeypatch
):
    manager = make(keep_checkpoints=1)
    manager.create_replay_buffer()
    write(manager, 2)
    mine = manager.checkpoint()
    write(manager, 1, first=2)
    store = CheckpointStore(manager.checkpoint_dir)

    def fail() -> None:
        raise OSError("the read failed part-way")

    during_read(monkeypatch, backend, fail)
    with pytest.raises(OSError, match="part-way"):
        manager.epoch_batches(4)
    monkeypatch.undo()
    # Nothing of the pass is left, the user's checkpoint is still the only one.
    assert [c.path for c in store.checkpoints()] == [mine]
    root = manager.checkpoint_dir
    assert os.listdir(os.path.join(root, REVERB_DIR)) == []
    snapshots = os.path.join(root, SNAPSHOTS_DIR)
    assert not os.path.isdir(snapshots) or os.listdir(snapshots) == []
    # Readable: the items are all there, a pass and sampling work.
    assert len(manager) == 15
    assert sorted(keys(manager)) == sorted((e, i) for e in range(3) for i in range(5))
    assert next(iter(manager.torch_batches(4))).observation.shape[0] == 4
    # Checkpointable, and the checkpoint restores every item.
    newest = manager.checkpoint()
    assert [c.path for c in store.checkpoints()] == [newest]
    manager.close()
    again = make(keep_checkpoints=1)
    again.load_replay_buffer()
    assert len(again) == 15


def _snapshot_marker(path: str, format_tag: str = SNAPSHOT_FORMAT) -> None:
    os.makedirs(path)
    with open(os.path.join(path, SNAPSHOT_MARKER_FILE), "w", encoding="utf-8") as f:
        json.dump({"format": format_tag}, f)


def test_a_start_deletes_only_provable_snapshots_and_follows_no_link(make, tmp_path):
    manager = make()
    manager.create_replay_buffer()
    write(manager, 2)
    manager.checkpoint()
    manager.close()
    root = tmp_path / "ckpt"
    snapshots = root / SNAPSHOTS_DIR
    token = "0123456789abcdef" * 2
    # A snapshot a killed process left: marker and checkpoint, and a link inside it.
    left = snapshots / f"snapshot-123-{token}"
    _snapshot_marker(str(left))
    (left / "checkpoint").mkdir()
    (left / "checkpoint" / "DONE").write_text("")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not replay_service's")
    os.symlink(outside, left / "checkpoint" / "link")
    # Killed between creating a snapshot directory and its marker.
    (snapshots / f"snapshot-124-{token}").mkdir()
    # Not provably snapshots: kept.
    kept = {
        "link": f"snapshot-125-{token}",  # a link to a directory with a marker
        "foreign_tag": f"snapshot-126-{token}",
        "no_marker": f"snapshot-127-{token}",
        "bad_name": "snapshot-x-1",
        "a_file": f"snapshot-128-{token}.txt",
    }
    marked_outside = tmp_path / "marked"
    _snapshot_marker(str(marked_outside))
    os.symlink(marked_outside, snapshots / kept["link"])
    _snapshot_marker(str(snapshots / kept["foreign_tag"]), "something/1")
    (snapshots / kept["no_marker"]).mkdir()
    (snapshots / kept["no_marker"] / "data.bin").write_bytes(b"x")
    _snapshot_marker(str(snapshots / kept["bad_name"]))
    (snapshots / kept["a_file"]).write_text("x")
    outside_before = tree_digest(outside)
    marked_before = tree_digest(marked_outside)

    again = make()
    again.load_replay_buffer()
    assert len(again) == 10
    assert sorted(os.listdir(snapshots)) == sorted(kept.values())
    assert tree_digest(outside) == outside_before
    assert tree_digest(marked_outside) == marked_before
    assert (snapshots / kept["no_marker"] / "data.bin").read_bytes() == b"x"


def test_a_linked_snapshots_directory_is_refused_and_nothing_outside_is_touched(make, tmp_path):
    manager = make()
    manager.create_replay_buffer()
    write(manager, 1)
    manager.checkpoint()
    manager.close()
    root = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    _snapshot_marker(str(outside / f"snapshot-1-{'ab' * 16}"))
    before = tree_digest(outside)
    os.symlink(outside, root / SNAPSHOTS_DIR)
    again = make()
    with pytest.raises(CheckpointError, match=r"\.snapshots'? is a symbolic link"):
        again.load_replay_buffer()
    assert tree_digest(outside) == before
