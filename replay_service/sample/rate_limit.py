"""Rate limiting in a single-process collect/train loop, without deadlock.

Reverb's `SampleToInsertRatio` limiter keeps `diff = inserts * samples_per_insert - samples`
inside a band `[min_diff, max_diff]` of width `2 * error_buffer`: a sample waits while
`diff - 1 < min_diff`, an insert while `diff + samples_per_insert > max_diff` (and every insert
passes until the table holds `min_size_to_sample` items). With collectors and learners in
separate threads or processes that is what one wants. In one thread that alternates collecting
and training, a blocked call can never be released, because the only call that would release it
is the one that thread would make next: the loop deadlocks (or, with replay_service's timeouts,
fails after `Timeouts.sample` / `Timeouts.write`).

The rule that makes a single-threaded loop safe: train only when a whole batch can be sampled,
otherwise collect; and make the band wide enough that one of the two is always possible,

    2 * error_buffer >= batch_size + samples_per_insert * IN_FLIGHT

(a batch must fit under the band, and so must the items a collector may have in flight before it
waits for the server). `TrainSchedule` applies the rule: it checks the band up front and tells
the loop, step by step, whether to train or to collect.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from replay_service.collect.observer import FLUSH_DOWN_TO, FLUSH_EVERY
from replay_service.config.options import require_positive_int
from replay_service.errors import ConfigError, WriteTimeoutError

# Items of one table a writer may have in flight (unconfirmed) before it waits, plus one.
IN_FLIGHT = FLUSH_DOWN_TO + FLUSH_EVERY + 1

COUNT_WAIT_MS = 100
"""`flush_for_count` waits this long at a time for the writers' items to be confirmed before it
asks whether a rate limiter holds them back (a confirmation takes a round trip otherwise)."""


class Flushable(Protocol):
    """A collector whose written items can be waited for (observers and writers)."""

    def flush(self, timeout_ms: int | None = None) -> None:
        """Blocks until the items written so far are confirmed (within `timeout_ms`)."""


def flush_for_count(
    writers: Iterable[Flushable],
    read_state: Callable[[str], LimiterState] | None,
    tables: Sequence[str],
    write_s: float | None,
) -> None:
    """Flushes `writers` before a count of items, in waits of `COUNT_WAIT_MS`: it stops waiting,
    without an error, once a table's rate limiter blocks inserts (their items reach the table
    when samples let them in; waiting for them could only time out).

    Args:
      writers: The buffer's observers and writers.
      read_state: A table's `LimiterState` by name; None where the backend has no rate
        limiters (every writer is flushed with its own timeout).
      tables: The names of the buffer's tables.
      write_s: `Timeouts.write`: the bound on the whole wait (None: no bound).

    Raises:
      WriteTimeoutError: If the items are not confirmed within `write_s` while no limiter
        blocks inserts.
    """
    if read_state is None:
        for writer in writers:
            writer.flush()
        return
    deadline = math.inf if write_s is None else time.monotonic() + write_s
    while True:
        try:
            for writer in writers:
                writer.flush(COUNT_WAIT_MS)
            return
        except WriteTimeoutError:
            if time.monotonic() >= deadline:
                raise
            if any(not read_state(name).can_insert() for name in tables):
                return


@dataclasses.dataclass(frozen=True)
class LimiterState:
    """A table's rate limiter and its counters, as reported by the server.

    Attributes:
      samples_per_insert: Target ratio (1.0 for `MinSize`).
      min_diff: Lower end of the band of `inserts * samples_per_insert - samples`.
      max_diff: Upper end of that band.
      min_size_to_sample: Items needed before any sample.
      inserts: Items inserted, as counted by the limiter.
      samples: Items sampled, as counted by the limiter.
      size: Items in the table now.
    """

    samples_per_insert: float
    min_diff: float
    max_diff: float
    min_size_to_sample: int
    inserts: int
    samples: int
    size: int

    @classmethod
    def from_info(cls, info: Any) -> LimiterState:
        """Reads a `reverb.TableInfo` (from `server_info`)."""
        limiter = info.rate_limiter_info
        return cls(
            samples_per_insert=float(limiter.samples_per_insert),
            min_diff=float(limiter.min_diff),
            max_diff=float(limiter.max_diff),
            min_size_to_sample=int(limiter.min_size_to_sample),
            inserts=int(limiter.insert_stats.completed),
            samples=int(limiter.sample_stats.completed),
            size=int(info.current_size),
        )

    @property
    def diff(self) -> float:
        """`inserts * samples_per_insert - samples`, which the limiter keeps in its band."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, num_inserts: int = 1) -> bool:
        """Whether `num_inserts` more items can be inserted now without waiting (Reverb's
        rule: inserts pass freely until the table holds `min_size_to_sample` items)."""
        if self.size + num_inserts <= self.min_size_to_sample:
            return True
        return self.diff + num_inserts * self.samples_per_insert <= self.max_diff

    def can_sample(self, num_samples: int = 1) -> bool:
        """Whether `num_samples` items can be sampled now without waiting (Reverb's rule)."""
        if self.size < self.min_size_to_sample:
            return False
        return self.diff - num_samples >= self.min_diff

    def inserts_needed(self, num_samples: int) -> int:
        """Items to insert before `num_samples` items can be sampled (0 if they can now)."""
        by_size = max(0, self.min_size_to_sample - self.size)
        short = self.min_diff + num_samples - self.diff
        by_ratio = max(0, math.ceil(short / self.samples_per_insert)) if short > 0 else 0
        return max(by_size, by_ratio)


def check_single_process_loop(
    batch_size: int,
    samples_per_insert: float,
    min_diff: float,
    max_diff: float,
    *,
    table_name: str = "",
) -> None:
    """Checks that a single-threaded collect/train loop on this limiter cannot deadlock.

    Args:
      batch_size: Items sampled per training step.
      samples_per_insert: The limiter's ratio.
      min_diff: Lower end of its band.
      max_diff: Upper end of its band.
      table_name: Named in the error.

    Raises:
      ConfigError: If the band is narrower than the rule in the module docstring, naming the
        error buffer the loop needs.
    """
    require_positive_int("batch_size", batch_size, maximum=None)
    needed = batch_size + samples_per_insert * (IN_FLIGHT)
    if max_diff - min_diff < needed:
        table = f"table {table_name!r}: " if table_name else ""
        raise ConfigError(
            f"{table}the rate limiter's error buffer {(max_diff - min_diff) / 2:g} is too small "
            f"for a single-process collect/train loop with batch_size {batch_size} and "
            f"samples_per_insert {samples_per_insert:g}: it needs error_buffer >= "
            f"{needed / 2:g} (= (batch_size + samples_per_insert * {IN_FLIGHT}) "
            "/ 2), or sampling and collecting would wait for each other forever"
        )


class TrainSchedule:
    """Tells a single-threaded collect/train loop when it may train without blocking.

    Call `ready()` once per loop iteration: True means sample one batch and train on it;
    False means collect one environment step (through any observer or writer of this
    table). The schedule asks the server only when its local count of steps still to collect
    runs out, flushing the writers first so that count is exact; Reverb's limiter then lets
    the batch through without waiting. Works with any limiter (with `MinSize` it just waits for
    `min_size_to_sample` items).

        schedule = manager.train_schedule(batch_size=64)
        iterator = iter(manager.get_dataset(batch_size=64))
        while trained < num_train_steps:
            if schedule.ready():
                train_step(next(iterator)); trained += 1
            else:
                time_step, policy_state = driver.run(time_step, policy_state)  # one step

    Args:
      read_state: Returns the table's `LimiterState` now.
      flush: Blocks until the items written so far reached the server.
      batch_size: Items sampled per training step.
      table_name: Named in errors.

    Raises:
      ConfigError: If the limiter's band breaks the rule of `check_single_process_loop`.
    """

    def __init__(
        self,
        read_state: Callable[[], LimiterState],
        flush: Callable[[], None],
        batch_size: int,
        *,
        table_name: str = "",
    ) -> None:
        state = read_state()
        check_single_process_loop(
            batch_size,
            state.samples_per_insert,
            state.min_diff,
            state.max_diff,
            table_name=table_name,
        )
        self._read_state = read_state
        self._flush = flush
        self._batch_size = batch_size
        self._to_collect = 0

    def ready(self) -> bool:
        """Whether a batch can be sampled now; if not, the caller collects one step.

        Returns:
          True to train on one batch now, False to collect one step first.
        """
        if self._to_collect > 0:
            self._to_collect -= 1
            return False
        self._flush()
        needed = self._read_state().inserts_needed(self._batch_size)
        if needed == 0:
            return True
        self._to_collect = needed - 1
        return False
