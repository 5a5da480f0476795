"""TensorBoard scalars of a buffer's stats, written every N seconds from a background thread.

    writer = StatsSummaryWriter(manager.stats, "runs/replay", interval_s=30.0)
    writer.start()
    ...
    writer.close()   # stops the thread (bounded join), flushes and closes the event file

Tags are `<table>/<figure>` and `checkpoint/<figure>` (`stats.scalars`), e.g.
`uniform_table/size`, `uniform_table/inserts_per_s`, `uniform_table/rate_limiter_sample_blocked_ms`,
`checkpoint/duration_s`; the step counts the writes (0, 1, 2, ...) and each event carries its
wall time. `ReplayBufferManager(..., summary_dir=...)` and `replay-server --tensorboard_dir` use
this class.
"""

from __future__ import annotations

import logging
import math
import os
import threading

from replay_service.config.options import require_number
from replay_service.errors import ConfigError
from replay_service.monitoring.stats import StatsReader, scalars

_log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0
# How long `close()` waits for a write in progress (a stats read is bounded by its own timeout).
DEFAULT_JOIN_TIMEOUT_S = 15.0
# TensorBoard scalars are float32.
_FLOAT32_MAX = 3.4e38


def check_logdir(logdir: str | os.PathLike[str], name: str = "summary directory") -> str:
    """Checks, without writing, that `logdir` is (or can be created as) a writable directory.

    Args:
      logdir: The directory the event file goes to.
      name: How the error names it (e.g. "--tensorboard_dir").

    Returns:
      `logdir` as a string.

    Raises:
      ConfigError: If it, or the nearest existing path above it, is not a directory, or that
        directory is not writable; the message names both paths.
    """
    path = os.fspath(logdir)
    if not path:
        raise ConfigError(f"{name} must be a directory path, got {path!r}")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        blocker = "" if existing == os.path.abspath(path) else f" ({existing!r} is a file)"
        raise ConfigError(f"{name} {path!r} is not a directory{blocker}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path!r} is not writable ({existing!r})")
    return path


class StatsSummaryWriter:
    """Writes `read_stats()` as TensorBoard scalars into `logdir` every `interval_s` seconds.

    The first write happens at `start()`, then one every interval; a failed read (the server
    unreachable for a moment) is logged and retried at the next interval.

    Args:
      read_stats: Returns the current `BufferStats` (e.g. `manager.stats`); it must bound its own
        waiting.
      logdir: Directory for the event file (created if missing).
      interval_s: Seconds between writes.
      join_timeout_s: Seconds `close()` waits for the thread.

    Raises:
      ConfigError: If `interval_s` is not a positive number or `logdir` cannot be created.
    """

    def __init__(
        self,
        read_stats: StatsReader,
        logdir: str | os.PathLike[str],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    ) -> None:
        self._interval_s = float(require_number("summary_interval_s", interval_s, 0, positive=True))
        self._logdir = os.fspath(logdir)
        try:
            os.makedirs(self._logdir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create summary directory {self._logdir!r}: {e}") from e
        self._read_stats = read_stats
        self._join_timeout_s = join_timeout_s
        from replay_service.backends.local.sampling import require_tensorflow

        self._tf = tf = require_tensorflow("summary_dir (TensorBoard summaries)")
        self._writer = tf.summary.create_file_writer(self._logdir)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._step = 0
        self._closed = False

    @property
    def logdir(self) -> str:
        """The event file's directory."""
        return self._logdir

    @property
    def writes(self) -> int:
        """Successful writes so far."""
        return self._step

    def start(self) -> None:
        """Starts the background thread (once)."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(
            target=self._run, name="replay_service:summaries", daemon=True
        )
        self._thread.start()

    def write(self) -> None:
        """Reads the stats once and writes them now.

        Raises:
          ReplayServiceError: If reading the stats fails (e.g. `ServerUnavailableError`).
        """
        values = {
            tag: value
            for tag, value in scalars(self._read_stats()).items()
            if math.isfinite(value) and abs(value) < _FLOAT32_MAX
        }
        with self._lock:
            if self._closed:
                return
            with self._writer.as_default():
                for tag, value in values.items():
                    self._tf.summary.scalar(tag, value, step=self._step)
            self._writer.flush()
            self._step += 1

    def _run(self) -> None:
        while True:
            try:
                self.write()
            except Exception as e:  # the writer must outlive a failed read and retry
                _log.warning("stats summary not written (will retry): %s", e)
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        """Stops the thread (waiting at most `join_timeout_s`), flushes and closes the file.

        Idempotent.
        """
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._join_timeout_s)
            if self._thread.is_alive():
                _log.warning(
                    "stats summary thread still busy after %.1f s; closing without it",
                    self._join_timeout_s,
                )
        with self._lock:
            self._closed = True
            self._writer.flush()
            self._writer.close()
