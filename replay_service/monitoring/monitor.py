"""`BufferMonitor`: a buffer's stats tracker and TensorBoard summaries, started and stopped as one.

`ReplayBufferManager` checks its `summary_dir` and `summary_interval_s` by building one, starts it
once its buffer exists (`create_replay_buffer`, `load_replay_buffer`), reads its `stats()` from
it and closes it in `close()`.
"""

from __future__ import annotations

import os

from replay_service.config.options import require_number, validate_path
from replay_service.monitoring.stats import (
    BufferStats,
    CheckpointStats,
    InfoSource,
    StatsReader,
    StatsTracker,
)
from replay_service.monitoring.summaries import StatsSummaryWriter


class BufferMonitor:
    """The stats of one buffer (`monitoring.stats`) and, with a `summary_dir`, their TensorBoard
    scalars written in the background (`monitoring.summaries`).

    Args:
      summary_dir: Directory of the event file; None: no summaries.
      summary_interval_s: Seconds between summary writes.

    Raises:
      ConfigError: If `summary_dir` is not a path (`config.options.validate_path`) or
        `summary_interval_s` is not a positive number; nothing is started.
    """

    def __init__(
        self, summary_dir: str | os.PathLike[str] | None, summary_interval_s: float
    ) -> None:
        self._summary_dir = (
            None if summary_dir is None else validate_path(summary_dir, "summary_dir")
        )
        self._interval_s = float(
            require_number("summary_interval_s", summary_interval_s, 0, positive=True)
        )
        self._tracker: StatsTracker | None = None
        self._writer: StatsSummaryWriter | None = None

    def start(self, client: InfoSource, timeout: float | None, read_stats: StatsReader) -> None:
        """Reads `client`'s server once (the start of the first rate window), then starts the
        summaries of `read_stats` (e.g. the manager's `stats`) if there is a `summary_dir`.

        Args:
          client: A client of the buffer's server.
          timeout: Seconds one stats read may take.
          read_stats: What the summaries write.

        Raises:
          ServerUnavailableError: If the server does not answer within `timeout`.
          ConfigError: If the summary directory cannot be created, or TensorFlow is missing.
        """
        self._tracker = StatsTracker(client, timeout=timeout)
        self._tracker.read(wait_for_rates=False)
        if self._summary_dir is not None:
            self._writer = StatsSummaryWriter(
                read_stats, self._summary_dir, interval_s=self._interval_s
            )
            self._writer.start()

    def read(self, checkpoint: CheckpointStats | None) -> BufferStats:
        """Each table's fill and rates now, with the last `checkpoint` as it is (after `start`).

        Raises:
          ServerUnavailableError: If the server does not answer within the `start` timeout.
        """
        assert self._tracker is not None, "BufferMonitor.read before start"
        return self._tracker.read(checkpoint)

    def close(self) -> None:
        """Stops the summaries (a bounded join) and closes their event file. Idempotent."""
        if self._writer is not None:
            self._writer.close()
