"""The `replay-server status` report: each table's counters, read once, and the last checkpoint.

What a running server holds (sizes, completed inserts and samples, sampler and remover), without
the rates that `stats.py` measures over a window; `replay-server status` prints it and
`sharded_status` sums it over shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replay_service.backends.reverb.connection import connect, server_info
from replay_service.monitoring.stats import samples_per_insert
from replay_service.specs.layouts import signature_layout
from replay_service.storage.store import CheckpointStore


@dataclasses.dataclass(frozen=True)
class TableReport:
    """One table's line of the status report: its counters, read once, and its selectors.

    Not merged with `stats.TableStats` (fill level, rates and rate limiter, measured over a
    window): `TableStats` is what `BufferStats.to_json()`, `replay-server status --json` and
    `ShardedStats.to_json()` write, key for key, and has no sampler or remover, which this
    report prints; one type for both would add those keys to that JSON, or print stats the
    text report never showed. Its samples per insert is the same ratio
    (`stats.samples_per_insert`).

    Attributes:
      name: Table name.
      size: Items stored.
      capacity: Maximum items.
      inserts: Completed inserts since the server started (or since the restored checkpoint).
      samples: Completed samples, counted the same way.
      sampler: Sampler name.
      remover: Remover name.
      layout: How its items store steps, from its signature: "packed" (a `uint8` row per
        step, which only clients from this package's `py_client` or managers write) or
        "nested"; "none" for a table without a signature.
    """

    name: str
    size: int
    capacity: int
    inserts: int
    samples: int
    sampler: str
    remover: str
    layout: str = "none"

    @property
    def samples_per_insert(self) -> float | None:
        """Observed samples per insert, or None before the first insert."""
        return samples_per_insert(self.samples, self.inserts)


def server_status(address: str, timeout: float | None = 10.0) -> list[TableReport]:
    """Reads every table's counters from the server at `address`.

    Raises:
      ServerUnavailableError: If no server answers within `timeout`.
    """
    infos = server_info(connect(address, timeout), timeout)
    return [_table_report(info) for _, info in sorted(infos.items())]


def _table_report(info: Any) -> TableReport:
    limiter = info.rate_limiter_info
    return TableReport(
        name=info.name,
        size=int(info.current_size),
        capacity=int(info.max_size),
        inserts=int(limiter.insert_stats.completed),
        samples=int(limiter.sample_stats.completed),
        sampler=_selector_name(info.sampler_options),
        remover=_selector_name(info.remover_options),
        layout=signature_layout(info.signature) or "none",
    )


def _selector_name(options: Any) -> str:
    names = [field.name for field, _ in options.ListFields() if field.name != "is_deterministic"]
    kind = names[0] if names else "unknown"
    if kind == "prioritized":
        return f"prioritized(exponent={options.prioritized.priority_exponent:g})"
    if kind == "heap":
        return "min_heap" if options.heap.min_heap else "max_heap"
    return kind


def table_line(table: TableReport) -> str:
    """One table's line of the status report."""
    ratio = "n/a" if table.samples_per_insert is None else f"{table.samples_per_insert:.2f}"
    return (
        f"table {table.name}: {table.size}/{table.capacity} items, {table.inserts} inserts, "
        f"{table.samples} samples, samples/insert {ratio}, sampler {table.sampler}, "
        f"remover {table.remover}, layout {table.layout}"
    )


def format_status(address: str, tables: list[TableReport], checkpoint_dir: str | None) -> str:
    """Renders `server_status` output (and the last checkpoint, if a directory is given)."""
    lines = [f"server {address}"]
    lines.extend(f"  {table_line(t)}" for t in tables)
    if checkpoint_dir is None:
        lines.append("  last checkpoint: unknown (pass --checkpoint_dir to read it)")
    else:
        latest = CheckpointStore(checkpoint_dir).latest()
        lines.append(
            "  last checkpoint: none"
            if latest is None
            else f"  last checkpoint: {latest.path} ({latest.info.get('created_at')}, "
            f"{latest.info.get('num_items')} items)"
        )
    return "\n".join(lines)
