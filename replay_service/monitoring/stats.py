"""How full a buffer is, how fast it fills and is sampled, and its last checkpoint.

One `StatsTracker` per server reads Reverb's `server_info` (sizes, the rate limiter's completed
insert and sample counts, the table worker's time blocked by the rate limiter) and keeps recent
readings, so that rates are measured over a window of up to `window_s` seconds:

    tracker = StatsTracker(client, timeout=10.0)
    stats = tracker.read(checkpoint=checkpoint_stats(server.last_checkpoint, duration_s))
    stats.tables[0].inserts_per_s; stats.to_json()

The manager (`ReplayBufferManager.stats()`), the sharded buffer (`ShardedReplayBuffer.stats()`),
`replay-server status --json`, the TensorBoard writer and the Prometheus exporter all read through
this module; it needs only a `reverb.Client` (or anything with `server_info(timeout=...)`).

Rate limiter blocking: Reverb 0.13 reports no per-call waits, but its table worker accumulates
the milliseconds it spent with inserts blocked until a sample arrives (`waiting_for_sampling_ms`)
and with samples blocked until an insert arrives (`waiting_for_inserts_ms`); over the window they
give the fraction of time inserts (or samples) were held back by the rate limiter.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from replay_service.backends.reverb.connection import connect, server_info
from replay_service.errors import ConfigError
from replay_service.specs.layouts import signature_layout
from replay_service.storage.metadata import Checkpoint

DEFAULT_WINDOW_S = 60.0
# With no earlier reading, `read` waits this long for a second one to measure rates.
DEFAULT_MIN_SPAN_S = 1.0
# Readings closer together than this are not kept (they add noise, not information).
_KEEP_EVERY_S = 0.25
_MAX_READINGS = 4096
# Rate limiter bounds at least this large are Reverb's "no bound" (it uses +-DBL_MAX).
_UNBOUNDED = 1e300


class InfoSource(Protocol):
    """What the tracker reads: a `reverb.Client` (or anything with the same `server_info`)."""

    @property
    def server_address(self) -> str:
        """ "host:port" of the server."""
        ...

    def server_info(self, timeout: int | None = None) -> Mapping[str, Any]:
        """Table name -> Reverb `TableInfo`."""
        ...


@dataclasses.dataclass(frozen=True)
class RateLimiterStats:
    """A table's rate limiter: its settings and how much it held calls back.

    Attributes:
      samples_per_insert: Configured samples per insert (1.0 for a `MinSize` limiter).
      min_diff: Lower bound of `inserts * samples_per_insert - samples`; samples wait below it.
        None when unbounded (Reverb's `MinSize` limiter uses the largest double).
      max_diff: Upper bound of that difference; inserts wait above it; None when unbounded.
      min_size_to_sample: Items needed before the first sample.
      diff: `inserts * samples_per_insert - samples` now.
      insert_blocked_ms: Milliseconds, since the server started, that the table had inserts
        waiting for a sample (Reverb's `waiting_for_sampling_ms`).
      sample_blocked_ms: Milliseconds the table had samples waiting for an insert
        (`waiting_for_inserts_ms`).
      insert_blocked_fraction: Share of the window with inserts blocked; None without a window.
      sample_blocked_fraction: Share of the window with samples blocked; None without a window.
    """

    samples_per_insert: float
    min_diff: float | None
    max_diff: float | None
    min_size_to_sample: int
    diff: float
    insert_blocked_ms: int
    sample_blocked_ms: int
    insert_blocked_fraction: float | None
    sample_blocked_fraction: float | None


@dataclasses.dataclass(frozen=True)
class TableStats:
    """One table's fill level and traffic.

    Attributes:
      name: Table name.
      size: Items stored.
      capacity: Maximum items.
      fill_ratio: `size / capacity`.
      inserts: Completed inserts since the server started (continued from a restored checkpoint).
      samples: Completed samples, counted the same way.
      inserts_per_s: Inserts per second over the window; None without one.
      samples_per_s: Samples per second over the window; None without one.
      samples_per_insert: `samples / inserts` since the start; None before the first insert.
      window_samples_per_insert: The same over the window; None without inserts in it.
      rate_limiter: The rate limiter's settings and blocking.
      layout: How a Reverb table's items store steps, from its signature: "packed" or
        "nested" (see `specs.layouts.signature_layout`); None without a signature (the local
        backend's tables).
    """

    name: str
    size: int
    capacity: int
    fill_ratio: float
    inserts: int
    samples: int
    inserts_per_s: float | None
    samples_per_s: float | None
    samples_per_insert: float | None
    window_samples_per_insert: float | None
    rate_limiter: RateLimiterStats
    layout: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """The last complete checkpoint.

    Attributes:
      path: Its directory.
      created_at: ISO-8601 UTC time it was recorded.
      timestamp: The same as Unix seconds.
      duration_s: Seconds it took (write, verification and move), when the process that took it
        measured it; None for checkpoints adopted or read from the directory.
      bytes: Total size of its data files; None for checkpoints without recorded files.
      num_items: Items it holds (every table); None if unknown.
    """

    path: str
    created_at: str | None
    timestamp: float | None
    duration_s: float | None
    bytes: int | None
    num_items: int | None


@dataclasses.dataclass(frozen=True)
class BufferStats:
    """Every table of one server, and its last checkpoint.

    Attributes:
      address: "host:port" of the server.
      timestamp: Unix seconds of the reading.
      window_s: Seconds the rates are measured over; None if there was no earlier reading.
      tables: One entry per table, sorted by name.
      checkpoint: The last checkpoint, if known.
    """

    address: str
    timestamp: float
    window_s: float | None
    tables: tuple[TableStats, ...]
    checkpoint: CheckpointStats | None

    def table(self, name: str) -> TableStats:
        """Returns the stats of table `name`.

        Raises:
          ConfigError: If the server has no such table (the message lists its tables).
        """
        for table in self.tables:
            if table.name == name:
                return table
        raise ConfigError(
            f"no table {name!r} at {self.address!r}; its tables are {[t.name for t in self.tables]}"
        )

    def to_json(self) -> dict[str, Any]:
        """Returns a JSON-serializable dict of every field."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Reading:
    at: float
    counts: dict[str, tuple[int, int, int, int]]  # inserts, samples, insert/sample blocked ms


def _counts(info: Any) -> tuple[int, int, int, int]:
    limiter = info.rate_limiter_info
    worker = info.table_worker_time
    return (
        int(limiter.insert_stats.completed),
        int(limiter.sample_stats.completed),
        int(worker.waiting_for_sampling_ms),
        int(worker.waiting_for_inserts_ms),
    )


class StatsTracker:
    """Reads a server's table stats and measures rates over recent readings. Thread-safe.

    Args:
      client: A client of the server (`reverb.Client`).
      timeout: Seconds one `server_info` call may take.
      window_s: Rates are measured from the oldest reading at most this old.
      min_span_s: With no earlier reading, `read` takes a second one this many seconds later.

    Raises:
      ConfigError: If `window_s` or `min_span_s` is not a positive number.
    """

    def __init__(
        self,
        client: InfoSource,
        *,
        timeout: float | None = 10.0,
        window_s: float = DEFAULT_WINDOW_S,
        min_span_s: float = DEFAULT_MIN_SPAN_S,
    ) -> None:
        for name, value in (("window_s", window_s), ("min_span_s", min_span_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        self._client = client
        self._timeout = timeout
        self._window_s = float(window_s)
        self._min_span_s = float(min_span_s)
        self._readings: collections.deque[_Reading] = collections.deque(maxlen=_MAX_READINGS)
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        """ "host:port" of the server."""
        return str(self._client.server_address)

    def read(
        self, checkpoint: CheckpointStats | None = None, *, wait_for_rates: bool = True
    ) -> BufferStats:
        """Reads every table now and measures rates against the oldest reading in the window.

        Args:
          checkpoint: The last checkpoint, to include as it is.
          wait_for_rates: With no earlier reading, take a second one `min_span_s` later so that
            rates are known; False returns None rates instead.

        Returns:
          The stats of every table.

        Raises:
          ServerUnavailableError: If the server does not answer within `timeout`.
        """
        infos, now = self._info()
        with self._lock:
            base = self._base(now)
        if base is None and wait_for_rates:
            self._remember(_Reading(now, {n: _counts(i) for n, i in infos.items()}))
            time.sleep(self._min_span_s)
            infos, now = self._info()
            with self._lock:
                base = self._base(now)
        reading = _Reading(now, {n: _counts(i) for n, i in infos.items()})
        self._remember(reading)
        window = now - base.at if base is not None and now > base.at else None
        tables = tuple(
            _table_stats(infos[name], reading.counts[name], base, window) for name in sorted(infos)
        )
        return BufferStats(
            address=self.address,
            timestamp=time.time(),
            window_s=window,
            tables=tables,
            checkpoint=checkpoint,
        )

    def _info(self) -> tuple[Mapping[str, Any], float]:
        infos = server_info(self._client, self._timeout)  # type: ignore[arg-type]
        return infos, time.monotonic()

    def _base(self, now: float) -> _Reading | None:
        readings = self._readings
        while len(readings) > 1 and readings[1].at <= now - self._window_s:
            readings.popleft()
        return readings[0] if readings else None

    def _remember(self, reading: _Reading) -> None:
        with self._lock:
            if not self._readings or reading.at - self._readings[-1].at >= _KEEP_EVERY_S:
                self._readings.append(reading)


def _rate(now: int, before: int, window: float | None) -> float | None:
    if window is None or now < before:  # no window, or the counters restarted
        return None
    return (now - before) / window


def _table_stats(
    info: Any, counts: tuple[int, int, int, int], base: _Reading | None, window: float | None
) -> TableStats:
    inserts, samples, insert_ms, sample_ms = counts
    before = base.counts.get(info.name) if base is not None else None
    if before is None:
        window = None
        before = counts
    inserts_per_s = _rate(inserts, before[0], window)
    samples_per_s = _rate(samples, before[1], window)
    window_ms = window * 1000.0 if window else None
    limiter = info.rate_limiter_info
    window_inserts = inserts - before[0]
    return _with_ratios(
        layout=signature_layout(getattr(info, "signature", None)),
        name=str(info.name),
        size=int(info.current_size),
        capacity=int(info.max_size),
        inserts=inserts,
        samples=samples,
        inserts_per_s=inserts_per_s,
        samples_per_s=samples_per_s,
        window_samples_per_insert=(
            (samples - before[1]) / window_inserts
            if window is not None and window_inserts > 0 and samples >= before[1]
            else None
        ),
        rate_limiter=RateLimiterStats(
            samples_per_insert=float(limiter.samples_per_insert),
            min_diff=_bound(limiter.min_diff),
            max_diff=_bound(limiter.max_diff),
            min_size_to_sample=int(limiter.min_size_to_sample),
            diff=inserts * float(limiter.samples_per_insert) - samples,
            insert_blocked_ms=insert_ms,
            sample_blocked_ms=sample_ms,
            insert_blocked_fraction=_fraction(insert_ms - before[2], window_ms),
            sample_blocked_fraction=_fraction(sample_ms - before[3], window_ms),
        ),
    )


def _with_ratios(
    *, size: int, capacity: int, inserts: int, samples: int, **rest: Any
) -> TableStats:
    """A `TableStats` of these counts and `rest` (the other fields), its fill ratio and samples
    per insert since the start computed from the counts."""
    return TableStats(
        size=size,
        capacity=capacity,
        fill_ratio=size / capacity if capacity else 0.0,
        inserts=inserts,
        samples=samples,
        samples_per_insert=samples_per_insert(samples, inserts),
        **rest,
    )


def samples_per_insert(samples: int, inserts: int) -> float | None:
    """Observed samples per insert.

    Args:
      samples: Completed samples.
      inserts: Completed inserts, counted over the same span.

    Returns:
      `samples / inserts`, or None before the first insert.
    """
    return samples / inserts if inserts else None


def _bound(value: float) -> float | None:
    return None if abs(value) >= _UNBOUNDED else float(value)


def _fraction(blocked_ms: int, window_ms: float | None) -> float | None:
    if window_ms is None or blocked_ms < 0:
        return None
    return min(1.0, blocked_ms / window_ms)


def checkpoint_stats(
    checkpoint: Checkpoint | None, duration_s: float | None = None
) -> CheckpointStats | None:
    """Describes a checkpoint (None gives None).

    Args:
      checkpoint: A complete checkpoint (e.g. `CheckpointedServer.last_checkpoint`, or
        `CheckpointStore.latest()`).
      duration_s: Seconds it took, if measured.

    Returns:
      Its path, time, duration, size in bytes and item count.
    """
    if checkpoint is None:
        return None
    created_at = checkpoint.info.get("created_at")
    timestamp = None
    if isinstance(created_at, str):
        try:
            timestamp = datetime.datetime.fromisoformat(created_at).timestamp()
        except ValueError:
            timestamp = None
    files = checkpoint.files
    size = None
    if files is not None:
        size = sum(int(f.get("size", 0)) for f in files.values() if isinstance(f, dict))
    return CheckpointStats(
        path=checkpoint.path,
        created_at=created_at if isinstance(created_at, str) else None,
        timestamp=timestamp,
        duration_s=duration_s,
        bytes=size,
        num_items=checkpoint.num_items,
    )


def server_stats(
    address: str,
    timeout: float | None = 10.0,
    *,
    span_s: float = DEFAULT_MIN_SPAN_S,
    checkpoint: CheckpointStats | None = None,
) -> BufferStats:
    """Connects to the server at `address` and reads its stats, rates over `span_s` seconds.

    Raises:
      ConfigError: If `address` is not "host:port" or `span_s` is not positive.
      ServerUnavailableError: If no server answers within `timeout`.
    """
    tracker = StatsTracker(connect(address, timeout), timeout=timeout, min_span_s=span_s)
    return tracker.read(checkpoint)


def total_table(name: str, tables: Sequence[TableStats]) -> TableStats:
    """Sums one table's stats over shards: counts, capacities, rates and blocked time.

    Rates are None if any shard's is; ratios are recomputed from the sums; rate limiter settings
    are the first shard's, blocked fractions the mean over shards.

    Raises:
      ConfigError: If `tables` is empty.
    """
    if not tables:
        raise ConfigError(f"no shard stats to sum for table {name!r}")
    inserts_per_s = _sum_or_none([t.inserts_per_s for t in tables])
    samples_per_s = _sum_or_none([t.samples_per_s for t in tables])
    limiters = [t.rate_limiter for t in tables]
    first = limiters[0]
    layouts = {t.layout for t in tables}
    return _with_ratios(
        layout=layouts.pop() if len(layouts) == 1 else "/".join(sorted(map(str, layouts))),
        name=name,
        size=sum(t.size for t in tables),
        capacity=sum(t.capacity for t in tables),
        inserts=sum(t.inserts for t in tables),
        samples=sum(t.samples for t in tables),
        inserts_per_s=inserts_per_s,
        samples_per_s=samples_per_s,
        window_samples_per_insert=(
            samples_per_s / inserts_per_s if inserts_per_s and samples_per_s is not None else None
        ),
        rate_limiter=RateLimiterStats(
            samples_per_insert=first.samples_per_insert,
            min_diff=first.min_diff,
            max_diff=first.max_diff,
            min_size_to_sample=first.min_size_to_sample,
            diff=sum(r.diff for r in limiters),
            insert_blocked_ms=sum(r.insert_blocked_ms for r in limiters),
            sample_blocked_ms=sum(r.sample_blocked_ms for r in limiters),
            insert_blocked_fraction=_mean_or_none([r.insert_blocked_fraction for r in limiters]),
            sample_blocked_fraction=_mean_or_none([r.sample_blocked_fraction for r in limiters]),
        ),
    )


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(sum(v for v in values if v))


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    total = _sum_or_none(values)
    return None if total is None else total / len(values)


def scalars(stats: BufferStats) -> dict[str, float]:
    """Flattens stats into `"<table>/<figure>"` and `"checkpoint/<figure>"` -> value.

    Figures that are unknown (None) are left out. TensorBoard tags use these names.
    """
    values: dict[str, float] = {}
    for table in stats.tables:
        for key, value in table_figures(table).items():
            values[f"{table.name}/{key}"] = value
    for key, value in checkpoint_figures(stats.checkpoint).items():
        values[f"checkpoint/{key}"] = value
    return values


def table_figures(table: TableStats) -> dict[str, float]:
    """A table's numeric figures by name (rate limiter ones prefixed `rate_limiter_`)."""
    figures: dict[str, float | None] = {
        "size": table.size,
        "capacity": table.capacity,
        "fill_ratio": table.fill_ratio,
        "inserts": table.inserts,
        "samples": table.samples,
        "inserts_per_s": table.inserts_per_s,
        "samples_per_s": table.samples_per_s,
        "samples_per_insert": table.samples_per_insert,
        "window_samples_per_insert": table.window_samples_per_insert,
    }
    for field in dataclasses.fields(RateLimiterStats):
        figures[f"rate_limiter_{field.name}"] = getattr(table.rate_limiter, field.name)
    return {k: float(v) for k, v in figures.items() if v is not None}


def checkpoint_figures(checkpoint: CheckpointStats | None) -> dict[str, float]:
    """The last checkpoint's numeric figures (timestamp, duration_s, bytes, num_items)."""
    if checkpoint is None:
        return {}
    figures = {
        "timestamp": checkpoint.timestamp,
        "duration_s": checkpoint.duration_s,
        "bytes": checkpoint.bytes,
        "num_items": checkpoint.num_items,
    }
    return {k: float(v) for k, v in figures.items() if v is not None}


StatsReader = Callable[[], BufferStats]

__all__ = [
    "BufferStats",
    "CheckpointStats",
    "RateLimiterStats",
    "StatsReader",
    "StatsTracker",
    "TableStats",
    "checkpoint_figures",
    "checkpoint_stats",
    "samples_per_insert",
    "scalars",
    "server_stats",
    "table_figures",
    "total_table",
]
