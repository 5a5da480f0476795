"""`CheckpointSchedule`: taking a buffer's checkpoints, on demand and on a schedule.

Both backends (the Reverb server's owner, `CheckpointedServer`, and the local backend) take
their checkpoints through one `CheckpointSchedule`: it holds the lock under which one checkpoint
at a time is written and adopted (`CheckpointStore.commit`), records the last checkpoint, how
long it took and the last periodic failure, and runs the background thread that checkpoints
every interval (and, for a Reverb server, adopts the checkpoints remote clients request). How
a checkpoint is written stays with the backend: it hands `checkpoint` a writer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from replay_service.storage.metadata import Checkpoint, StoreMetadata
from replay_service.storage.store import CheckpointStore, WriteCheckpoint

_T = TypeVar("_T")

# How often an adopting schedule looks for checkpoints that remote clients requested.
ADOPT_POLL_S = 0.5


class CheckpointSchedule:
    """One buffer's checkpoints into `store`: the lock, the last one taken and the schedule.

    Args:
      store: The locked checkpoint directory.
      metadata: Store metadata recorded with every checkpoint.
      log: The owner's logger: checkpoints, adoptions and periodic failures are logged there.
      thread_name: Name of the schedule's thread.

    Attributes:
      last_checkpoint: The last checkpoint taken or adopted, or None.
      last_checkpoint_duration_s: Seconds `last_checkpoint` took (None for an adopted one).
      last_error: The last periodic checkpoint's failure, `"<type>: <message>"`; cleared by
        the next checkpoint that succeeds.
    """

    def __init__(
        self,
        store: CheckpointStore,
        metadata: StoreMetadata,
        *,
        log: logging.Logger,
        thread_name: str,
    ) -> None:
        self._store = store
        self._metadata = metadata
        self._log = log
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_checkpoint: Checkpoint | None = None
        self.last_checkpoint_duration_s: float | None = None
        self.last_error: str | None = None

    def checkpoint(self, write: WriteCheckpoint) -> Checkpoint:
        """Takes a checkpoint with `write` (see `CheckpointStore.commit`) and records it.

        One checkpoint at a time: a second call waits for the first. The duration counts from
        the moment the lock is held.

        Args:
          write: Writes the checkpoint under the staging root it is given; returns
            `(path, verified)`.

        Returns:
          The adopted checkpoint.

        Raises:
          CheckpointError: As `CheckpointStore.commit`; the buffer keeps its items.
        """
        with self._lock:
            started = time.monotonic()
            checkpoint = self._store.commit(self._metadata, write)
            self.last_checkpoint = checkpoint
            self.last_checkpoint_duration_s = time.monotonic() - started
            self.last_error = None
        self._log.info("checkpoint %s (%s items)", checkpoint.path, checkpoint.num_items)
        return checkpoint

    def snapshot(self, write: WriteCheckpoint, read: Callable[[str], _T]) -> _T:
        """A checkpoint that is read and deleted, never adopted (`CheckpointStore.snapshot`).

        It is written and moved out of the staging root under the lock (no checkpoint of the
        schedule's runs meanwhile) and read after the lock is released: checkpoints and
        adoptions go on while it is read.

        Raises:
          CheckpointError: As `CheckpointStore.snapshot`.
        """
        return self._store.snapshot(self._metadata, write, read, guard=self._lock)

    def adopt_staged(self) -> list[Checkpoint]:
        """Adopts complete checkpoints that clients requested (`CheckpointStore.adopt_staged`).

        Returns:
          The checkpoints adopted, oldest first; the newest becomes `last_checkpoint`.

        Raises:
          CheckpointError: If a damaged one cannot be moved aside.
        """
        with self._lock:
            adopted = self._store.adopt_staged(self._metadata)
            for checkpoint in adopted:
                self.last_checkpoint = checkpoint
                self.last_checkpoint_duration_s = None
                self._log.info("adopted client checkpoint %s", checkpoint.path)
        return adopted

    def start(
        self, take: Callable[[], object], interval_s: float | None, *, adopt: bool = False
    ) -> None:
        """Starts the thread that calls `take()` every `interval_s` seconds. No-op if running.

        A failure is logged ("periodic checkpoint failed (will retry)"), kept in `last_error`
        and retried at the next interval; the thread survives anything.

        Args:
          take: Takes one checkpoint (the owner's `checkpoint`).
          interval_s: Seconds between checkpoints; None or 0 checkpoints only on request.
          adopt: Also adopt, every `ADOPT_POLL_S`, the checkpoints that clients request;
            checkpoints then start `interval_s` apart (back to back if one takes longer).
            Without it, each checkpoint starts `interval_s` after the previous one ended, and
            no thread starts when there is no interval.
        """
        if self._thread is not None or not (interval_s or adopt):
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(take, float(interval_s or 0.0), adopt),
            name=self._thread_name,
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout: float | None) -> None:
        """Stops the thread, waiting up to `timeout` seconds for a checkpoint it is taking
        (None: as long as it takes); `start` may then start it again."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self._thread = None

    def _run(self, take: Callable[[], object], interval_s: float, adopt: bool) -> None:
        stop = self._stop
        due = time.monotonic() + interval_s
        while not stop.wait(ADOPT_POLL_S if adopt else interval_s):
            try:
                if not adopt:
                    take()
                elif interval_s and time.monotonic() >= due:
                    due = time.monotonic() + interval_s
                    take()
                else:
                    self.adopt_staged()
            except Exception as e:  # the schedule must survive any failure and retry
                self.last_error = f"{type(e).__name__}: {e}"
                self._log.error("periodic checkpoint failed (will retry): %s", self.last_error)
