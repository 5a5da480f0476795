"""Prometheus `/metrics` of a buffer's stats (needs the `metrics` extra: prometheus-client).

    server = start_metrics_server(manager.stats, port=9100)   # 127.0.0.1 unless told otherwise
    ...                                                        # curl localhost:9100/metrics
    server.close()

Every scrape reads the stats once (`stats.StatsTracker`; rates over its window). Metrics, each
table labelled `table="<name>"`:

- gauges `replay_table_size`, `replay_table_capacity`, `replay_table_fill_ratio`,
  `replay_table_inserts_per_second`, `replay_table_samples_per_second`,
  `replay_table_samples_per_insert`, `replay_table_window_samples_per_insert`,
  `replay_rate_limiter_insert_blocked_fraction`, `replay_rate_limiter_sample_blocked_fraction`;
- counters `replay_table_inserts_total`, `replay_table_samples_total`,
  `replay_rate_limiter_insert_blocked_seconds_total`,
  `replay_rate_limiter_sample_blocked_seconds_total`;
- gauges `replay_last_checkpoint_timestamp_seconds`, `replay_last_checkpoint_duration_seconds`,
  `replay_last_checkpoint_bytes`, `replay_last_checkpoint_items` (when known);
- `replay_up`: 1 if the stats could be read, else 0 (the other metrics are then left out).

The endpoint has no authentication, like Reverb's port: it binds 127.0.0.1 by default.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator
from typing import Any

from replay_service.errors import ConfigError, PortInUseError, ServerError
from replay_service.monitoring.stats import BufferStats, StatsReader

_log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1"
JOIN_TIMEOUT_S = 5.0

# (metric name, TableStats attribute, help)
_TABLE_GAUGES = (
    ("replay_table_size", "size", "Items stored in the table."),
    ("replay_table_capacity", "capacity", "Maximum items of the table."),
    ("replay_table_fill_ratio", "fill_ratio", "size / capacity."),
    ("replay_table_inserts_per_second", "inserts_per_s", "Inserts per second, recent window."),
    ("replay_table_samples_per_second", "samples_per_s", "Samples per second, recent window."),
    ("replay_table_samples_per_insert", "samples_per_insert", "Samples per insert since start."),
    (
        "replay_table_window_samples_per_insert",
        "window_samples_per_insert",
        "Samples per insert over the recent window.",
    ),
)
_TABLE_COUNTERS = (
    ("replay_table_inserts", "inserts", "Completed inserts."),
    ("replay_table_samples", "samples", "Completed samples."),
)
_LIMITER_GAUGES = (
    (
        "replay_rate_limiter_insert_blocked_fraction",
        "insert_blocked_fraction",
        "Share of the recent window with inserts blocked by the rate limiter.",
    ),
    (
        "replay_rate_limiter_sample_blocked_fraction",
        "sample_blocked_fraction",
        "Share of the recent window with samples blocked by the rate limiter.",
    ),
)
_LIMITER_COUNTERS = (
    (
        "replay_rate_limiter_insert_blocked_seconds",
        "insert_blocked_ms",
        "Time with inserts blocked by the rate limiter.",
    ),
    (
        "replay_rate_limiter_sample_blocked_seconds",
        "sample_blocked_ms",
        "Time with samples blocked by the rate limiter.",
    ),
)
_CHECKPOINT_GAUGES = (
    ("replay_last_checkpoint_timestamp_seconds", "timestamp", "Unix time of the last checkpoint."),
    ("replay_last_checkpoint_duration_seconds", "duration_s", "Seconds the last checkpoint took."),
    ("replay_last_checkpoint_bytes", "bytes", "Bytes of the last checkpoint's data files."),
    ("replay_last_checkpoint_items", "num_items", "Items in the last checkpoint."),
)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ConfigError(
            "Prometheus metrics need prometheus-client: pip install 'replay_service[metrics]'"
        ) from e
    return prometheus_client


class _StatsCollector:
    """A prometheus-client collector that reads the stats on every scrape."""

    def __init__(self, read_stats: StatsReader) -> None:
        self._read_stats = read_stats

    def describe(self) -> list[Any]:
        return []  # the metrics are read at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("replay_up", "1 if the buffer's stats could be read.")
        try:
            stats = self._read_stats()
        except Exception as e:  # a scrape reports the failure instead of raising
            _log.warning("metrics scrape could not read the stats: %s", e)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from _families(stats, GaugeMetricFamily, CounterMetricFamily)


def _families(stats: BufferStats, gauge: Any, counter: Any) -> Iterator[Any]:
    # (metrics, family type, rate limiter's or table's, divisor to the metric's unit)
    per_table = (
        (_TABLE_GAUGES, gauge, False, 1),
        (_TABLE_COUNTERS, counter, False, 1),
        (_LIMITER_GAUGES, gauge, True, 1),
        (_LIMITER_COUNTERS, counter, True, 1000.0),  # milliseconds to seconds
    )
    for metrics, family_type, of_limiter, divisor in per_table:
        for name, attr, doc in metrics:
            family = family_type(name, doc, labels=["table"])
            for table in stats.tables:
                value = getattr(table.rate_limiter if of_limiter else table, attr)
                if value is not None:
                    family.add_metric([table.name], float(value) / divisor)
            yield family
    if stats.checkpoint is not None:
        for name, attr, doc in _CHECKPOINT_GAUGES:
            value = getattr(stats.checkpoint, attr)
            if value is not None:
                family = gauge(name, doc)
                family.add_metric([], float(value))
                yield family


class MetricsServer:
    """A running `/metrics` HTTP endpoint; `close()` stops it.

    Args:
      httpd: The HTTP server prometheus-client started.
      thread: Its serving thread.
    """

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the endpoint is bound to."""
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stops serving and waits for the thread (at most `JOIN_TIMEOUT_S`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(JOIN_TIMEOUT_S)


def start_metrics_server(
    read_stats: StatsReader, port: int, address: str = DEFAULT_ADDRESS
) -> MetricsServer:
    """Serves the stats on `http://address:port/metrics`.

    Args:
      read_stats: Returns the current `BufferStats` (bounding its own waiting).
      port: TCP port (1..65535).
      address: Interface to bind; 127.0.0.1 by default, "0.0.0.0" for every interface (the
        endpoint has no authentication).

    Returns:
      The running endpoint.

    Raises:
      ConfigError: If prometheus-client is missing or `port` is not in 1..65535.
      PortInUseError: If the port is taken (the message names it).
      ServerError: If the address cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"metrics port must be an integer in 1..65535, got {port!r}")
    prometheus_client = _prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(read_stats))
    try:
        httpd, thread = prometheus_client.start_http_server(port, address, registry=registry)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"metrics port {port} on {address} is already in use; choose another --metrics_port"
            ) from None
        raise ServerError(f"cannot serve metrics on {address}:{port}: {e}") from e
    _log.info("Prometheus metrics on http://%s:%d/metrics", address, port)
    return MetricsServer(httpd, thread)
