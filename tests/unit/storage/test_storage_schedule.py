"""`storage.schedule.CheckpointSchedule`: one checkpoint at a time, the last one recorded, and
the thread that checkpoints and adopts on a schedule (a store of the test's own: no backend).

`tests/integration/storage/test_checkpoint_steps.py` runs it on a real buffer's store.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from replay_service.errors import CheckpointError
from replay_service.storage import schedule as schedule_module
from replay_service.storage.metadata import Checkpoint, StoreMetadata
from replay_service.storage.schedule import CheckpointSchedule

pytestmark = pytest.mark.local

METADATA = StoreMetadata("t", 2, 10, [])
LOG = logging.getLogger("test_storage_schedule")


class FakeStore:
    """Records what the schedule asks of a `CheckpointStore`."""

    def __init__(self) -> None:
        self.commits = 0
        self.adoptable: list[Checkpoint] = []
        self.adopt_calls = 0
        self.guards: list[Any] = []

    def commit(self, metadata: StoreMetadata, write: Any) -> Checkpoint:
        assert metadata is METADATA
        path, _ = write("/staging")
        self.commits += 1
        return Checkpoint(path, self.commits, {"num_items": self.commits})

    def adopt_staged(self, metadata: StoreMetadata) -> list[Checkpoint]:
        self.adopt_calls += 1
        adopted, self.adoptable = self.adoptable, []
        return adopted

    def snapshot(self, metadata: StoreMetadata, write: Any, read: Any, guard: Any) -> Any:
        self.guards.append(guard)
        return read(write("/staging")[0])


def wait_for(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture()
def made(monkeypatch):
    monkeypatch.setattr(schedule_module, "ADOPT_POLL_S", 0.01)
    store = FakeStore()
    schedule = CheckpointSchedule(store, METADATA, log=LOG, thread_name="test-schedule")
    yield store, schedule
    schedule.stop(timeout=5)


def test_a_checkpoint_is_recorded_with_its_duration_and_clears_the_last_error(made):
    _, schedule = made
    schedule.last_error = "CheckpointError: disk full"
    checkpoint = schedule.checkpoint(lambda root: (f"{root}/a", None))
    assert checkpoint.path == "/staging/a" and schedule.last_checkpoint is checkpoint
    assert schedule.last_checkpoint_duration_s >= 0 and schedule.last_error is None


def test_a_failed_checkpoint_keeps_the_last_one_and_its_error_propagates(made):
    _, schedule = made
    first = schedule.checkpoint(lambda root: (f"{root}/a", None))

    def fail(root):
        raise CheckpointError("disk full")

    with pytest.raises(CheckpointError, match="disk full"):
        schedule.checkpoint(fail)
    assert schedule.last_checkpoint is first


def test_checkpoints_are_taken_one_at_a_time(made):
    _, schedule = made
    inside = threading.Event()
    release = threading.Event()
    order = []

    def slow(root):
        order.append("slow starts")
        inside.set()
        release.wait(5)
        order.append("slow ends")
        return f"{root}/slow", None

    def quick(root):
        order.append("quick")
        return f"{root}/quick", None

    first = threading.Thread(target=schedule.checkpoint, args=(slow,))
    first.start()
    inside.wait(5)
    second = threading.Thread(target=schedule.checkpoint, args=(quick,))
    second.start()
    time.sleep(0.02)
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["slow starts", "slow ends", "quick"]
    assert schedule.last_checkpoint.path == "/staging/quick"


def test_adopted_checkpoints_become_the_last_one_without_a_duration(made):
    store, schedule = made
    schedule.checkpoint(lambda root: (f"{root}/a", None))
    store.adoptable = [Checkpoint("/c/1", 1, {}), Checkpoint("/c/2", 2, {})]
    assert [c.path for c in schedule.adopt_staged()] == ["/c/1", "/c/2"]
    assert schedule.last_checkpoint.path == "/c/2"
    assert schedule.last_checkpoint_duration_s is None
    assert schedule.adopt_staged() == [] and schedule.last_checkpoint.path == "/c/2"


def test_a_snapshot_is_read_with_the_schedules_lock_as_guard(made):
    store, schedule = made
    assert schedule.snapshot(lambda root: (f"{root}/s", None), lambda path: path.upper()) == (
        "/STAGING/S"
    )
    assert store.guards == [schedule._lock]


def test_the_thread_takes_checkpoints_every_interval_and_restarts_after_stop(made):
    _, schedule = made
    taken = []
    schedule.start(lambda: taken.append(1), 0.01)
    schedule.start(lambda: pytest.fail("a second thread"), 0.01)  # running: no-op
    wait_for(lambda: len(taken) >= 2, "two checkpoints")
    schedule.stop(timeout=5)
    assert not any(t.name == "test-schedule" for t in threading.enumerate())
    count = len(taken)
    time.sleep(0.03)
    assert len(taken) == count
    schedule.start(lambda: taken.append(1), 0.01)
    wait_for(lambda: len(taken) > count, "a checkpoint after the restart")


def test_an_adopting_thread_adopts_between_checkpoints_and_survives_failures(made, caplog):
    store, schedule = made
    taken = []

    def take():
        taken.append(1)
        raise OSError("disk gone")

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        schedule.start(take, 0.05, adopt=True)
        wait_for(lambda: taken and store.adopt_calls >= 3, "a checkpoint and adoptions")
        store.adoptable = [Checkpoint("/c/9", 9, {})]
        wait_for(lambda: schedule.last_checkpoint is not None, "the adoption")
    assert schedule.last_checkpoint.path == "/c/9"
    assert schedule.last_error == "OSError: disk gone"
    assert "periodic checkpoint failed (will retry): OSError: disk gone" in caplog.messages


def test_adoption_without_an_interval_only_adopts(made):
    store, schedule = made
    schedule.start(lambda: pytest.fail("no checkpoint without an interval"), None, adopt=True)
    wait_for(lambda: store.adopt_calls >= 3, "adoptions")
    assert store.commits == 0
