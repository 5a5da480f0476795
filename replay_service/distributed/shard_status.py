"""A sharded buffer's status and stats: every shard's tables, and the sharded table's totals."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from replay_service.config.options import DEFAULT_TABLE_NAME
from replay_service.errors import (
    SpecMismatchError,
)
from replay_service.monitoring.report import TableReport, server_status, table_line
from replay_service.monitoring.stats import BufferStats, TableStats

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardStatus:
    """One shard's tables.

    Attributes:
      address: The shard's "host:port".
      tables: Every table of that server (`replay_service.monitoring.report.server_status`).
    """

    address: str
    tables: tuple[TableReport, ...]


@dataclasses.dataclass(frozen=True)
class ShardedStatus:
    """All shards of one table, and the table's totals.

    Attributes:
      table_name: The sharded table.
      shards: One entry per shard, in shard order.
      total: The table's counters summed over the shards (size, capacity, inserts, samples);
        sampler and remover are the shards' own, or every distinct one joined by "/".
    """

    table_name: str
    shards: tuple[ShardStatus, ...]
    total: TableReport


def sharded_status(
    addresses: Sequence[str], table_name: str = DEFAULT_TABLE_NAME, timeout: float | None = 10.0
) -> ShardedStatus:
    """Reads every shard's counters (in parallel) and sums those of `table_name`.

    Args:
      addresses: The shards' "host:port", in shard order.
      table_name: The sharded table; every shard must serve it.
      timeout: Seconds to wait for each server.

    Returns:
      Per-shard status and totals.

    Raises:
      ServerUnavailableError: If a shard does not answer within `timeout` (naming it).
      SpecMismatchError: If a shard does not serve `table_name`.
    """
    results = on_every_shard(list(addresses), lambda _, a: server_status(a, timeout))
    shards = tuple(
        ShardStatus(address=a, tables=tuple(t)) for a, t in zip(addresses, results, strict=True)
    )
    return ShardedStatus(table_name=table_name, shards=shards, total=_total(table_name, shards))


def _total(table_name: str, shards: Sequence[ShardStatus]) -> TableReport:
    tables = []
    for shard in shards:
        match = [t for t in shard.tables if t.name == table_name]
        if not match:
            raise SpecMismatchError(
                f"shard {shard.address!r} has no table {table_name!r}; its tables are "
                f"{sorted(t.name for t in shard.tables)}"
            )
        tables.append(match[0])
    return TableReport(
        name=table_name,
        size=sum(t.size for t in tables),
        capacity=sum(t.capacity for t in tables),
        inserts=sum(t.inserts for t in tables),
        samples=sum(t.samples for t in tables),
        sampler="/".join(dict.fromkeys(t.sampler for t in tables)),
        remover="/".join(dict.fromkeys(t.remover for t in tables)),
        layout="/".join(dict.fromkeys(t.layout for t in tables)),
    )


def format_sharded_status(status: ShardedStatus) -> str:
    """Renders `sharded_status` output: the totals, then one block per shard."""
    lines = [f"sharded buffer, {len(status.shards)} shard(s), total {table_line(status.total)}"]
    for index, shard in enumerate(status.shards):
        lines.append(f"  shard {index} {shard.address}")
        lines.extend(f"    {table_line(t)}" for t in shard.tables)
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ShardedStats:
    """Fill level and traffic of every shard, and of the sharded table in total.

    Attributes:
      table_name: The sharded table.
      shards: Each shard's `BufferStats` (every table of that server), in shard order.
      total: The sharded table summed over shards (`stats.total_table`).
    """

    table_name: str
    shards: tuple[BufferStats, ...]
    total: TableStats

    def to_json(self) -> dict[str, Any]:
        """Returns a JSON-serializable dict of every field."""
        return dataclasses.asdict(self)


def on_every_shard(shards: list[_T], fn: Callable[[int, _T], Any]) -> list[Any]:
    """Runs `fn(index, shard)` for every shard in parallel; returns results in shard order.

    Every call must bound its own waiting (they all use the configured timeouts).

    Raises:
      Exception: The error of the lowest-numbered shard that failed (others are logged).
    """
    if len(shards) == 1:
        return [fn(0, shards[0])]
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=len(shards), thread_name_prefix="replay_service:shard"
    ) as pool:
        futures = [pool.submit(fn, i, shard) for i, shard in enumerate(shards)]
        concurrent.futures.wait(futures)
    errors = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
    for index, error in errors[1:]:
        _log.warning("shard %d failed too: %s", index, error)
    if errors:
        raise errors[0][1]  # type: ignore[misc]
    return [f.result() for f in futures]
