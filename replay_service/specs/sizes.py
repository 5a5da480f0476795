"""How many bytes a data spec's steps take, and how many this machine has for them.

A buffer's sizes are checked before anything is allocated: an item too large to be held in
memory at all (`check_item_fits`, every backend) when its manager is made, and local tables
whose step rings cannot fit in the memory or on the disk they would take (the local backend's
`check_tables_fit`) when the buffer is created or loaded, before anything is written. Either
raises a `ConfigError` naming the largest fields with their shapes, the bytes per step, the
total and the bytes available. Without them a shape such as `(10**6, 10**6)` was accepted and
failed late (`MemoryError` at the first write) or committed pages until the process was
killed. What is stored does not change.

No TensorFlow, Reverb or torch is imported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_service.errors import ConfigError

# Files that give the memory this process may still take: the kernel's estimate of what can
# be allocated without swapping, then the cgroup's limit (a container's) less its usage.
_MEMINFO = "/proc/meminfo"
_CGROUP_V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
_CGROUP_V1 = (
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    "/sys/fs/cgroup/memory/memory.usage_in_bytes",
)
# How many fields an error names, largest first.
_NAMED_FIELDS = 3


@dataclasses.dataclass(frozen=True)
class FieldSize:
    """One field of a step: its path, shape, dtype and bytes (None dimensions count as 1)."""

    path: str
    shape: tuple[int | None, ...]
    dtype: str
    nbytes: int

    def describe(self) -> str:
        """`'path' [shape] dtype: N bytes` for an error message."""
        shape = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.path!r} [{shape}] {self.dtype}: {self.nbytes} bytes"


def field_sizes(fields: Sequence[dict[str, Any]]) -> list[FieldSize]:
    """The size of each field of one step.

    Args:
      fields: `specs.describe_spec(spec)`: `{"path", "dtype", "shape"}` per field.

    Returns:
      One `FieldSize` per field, in order (Python integers: no overflow however large).
    """
    sizes = []
    for field in fields:
        shape = tuple(None if d is None else int(d) for d in field["shape"])
        try:
            itemsize = np.dtype(field["dtype"]).itemsize
        except TypeError:  # a dtype numpy does not know (e.g. a TF string): sized by its use
            itemsize = 0
        count = math.prod(1 if d is None else max(d, 0) for d in shape)
        sizes.append(FieldSize(str(field["path"]), shape, str(field["dtype"]), count * itemsize))
    return sizes


def step_bytes(fields: Sequence[dict[str, Any]]) -> int:
    """Bytes of one step of `fields` (`specs.describe_spec` output)."""
    return sum(f.nbytes for f in field_sizes(fields))


def human(nbytes: int) -> str:
    """`nbytes` in binary units, e.g. "3.6 TiB"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def largest_fields(fields: Sequence[dict[str, Any]]) -> str:
    """The largest fields of a step, described for an error (at most `_NAMED_FIELDS`)."""
    ordered = sorted(field_sizes(fields), key=lambda f: f.nbytes, reverse=True)
    shown = ", ".join(f.describe() for f in ordered[:_NAMED_FIELDS])
    more = len(ordered) - _NAMED_FIELDS
    return shown + (f" (and {more} smaller)" if more > 0 else "")


def available_memory() -> int | None:
    """Bytes of memory this process can still allocate without swapping; None if unknown.

    Linux: `MemAvailable` of /proc/meminfo, and at most what the process's cgroup (a
    container's memory limit, v2 or v1) leaves, its reclaimable file cache counted as free.
    Elsewhere: the free physical pages where `os.sysconf` tells them, else None.
    """
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError), open(_MEMINFO, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    for limit_file, usage_file in (_CGROUP_V2, _CGROUP_V1):
        left = _cgroup_left(limit_file, usage_file)
        if left is not None:
            found.append(left)
            break
    if not found:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found) if found else None


def _cgroup_left(limit_file: str, usage_file: str) -> int | None:
    """A cgroup's memory limit less its usage (its inactive file cache counted as free);
    None without a limit or where the files cannot be read."""
    try:
        with open(limit_file, encoding="ascii") as f:
            limit_text = f.read().strip()
        with open(usage_file, encoding="ascii") as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= 1 << 60:  # "max", or v1's "unlimited"
        return None
    inactive = 0
    stat_file = os.path.join(os.path.dirname(usage_file), "memory.stat")
    with contextlib.suppress(OSError, ValueError), open(stat_file, encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                inactive = int(value)
                break
    return max(int(limit_text) - max(usage - inactive, 0), 0)


def check_item_fits(fields: Sequence[dict[str, Any]], tables: Sequence[Any]) -> None:
    """Refuses a data spec whose items cannot be held in memory at all.

    Every backend holds at least one item in memory to write or sample it (its steps in the
    writer, the item in a batch), so an item larger than the memory available can never be
    stored. Nothing is allocated.

    Args:
      fields: `specs.describe_spec(stored_spec)` of one step.
      tables: The buffer's `TableConfig`s (their `capacity` and `sequence_length`).

    Raises:
      ConfigError: Naming the largest fields with their shapes and bytes per step, the bytes
        of one item and of the capacity, and the memory available.
    """
    available = available_memory()
    if available is None:
        return
    per_step = step_bytes(fields)
    length = max((t.sequence_length for t in tables), default=1)
    item = per_step * length
    if item <= available:
        return
    total = sum(t.capacity * t.sequence_length for t in tables) * per_step
    raise ConfigError(
        f"one item of this data spec takes {item} bytes ({human(item)}: {length} steps of "
        f"{per_step} bytes), more than the {available} bytes ({human(available)}) of memory "
        "available, so no item could ever be written or sampled (the capacity, "
        f"{', '.join(str(t.capacity) for t in tables)} items, would hold {total} bytes, "
        f"{human(total)}); the largest fields per step: {largest_fields(fields)}. Nothing was "
        "allocated: lower the field's shape (or the sequence_length)"
    )
