"""The ceiling of every batch size a sampling call takes, checked before anything is allocated.

A batch size has two bounds (`require_batch_size`):

- a fixed one, `MAX_BATCH_SIZE` items: no training step takes more, and an index array of that
  many draws alone is 128 MiB;
- the memory it needs: `batch_size * (item bytes + SAMPLE_INFO_BYTES)` must fit in
  `BATCH_MEMORY_FRACTION` of the memory available now (`specs.sizes.available_memory`:
  /proc/meminfo's MemAvailable, lowered to what the cgroup, e.g. a container's memory limit,
  has left): a batch is read, then copied at least once (unpacked, packed into transitions,
  moved to a device) before the previous one is freed.

A batch larger than a table's capacity is fine: items are drawn with replacement. Batches below
`SMALL_BATCH_BYTES` are not compared with the available memory (no file is read for them).
"""

from __future__ import annotations

from replay_service.config.options import require_positive_int
from replay_service.errors import ConfigError
from replay_service.specs.sizes import available_memory

MAX_BATCH_SIZE = 1 << 24
# Reverb's sample info per item: key, probability, table size, priority (8 bytes each) and
# times sampled (4).
SAMPLE_INFO_BYTES = 36
BATCH_MEMORY_FRACTION = 0.5
SMALL_BATCH_BYTES = 64 << 20


def require_batch_size(
    name: str, value: object, item_bytes: int, *, what: str = "", held: int | None = None
) -> int:
    """Checks a batch size before anything is allocated for it (see the module docstring).

    Args:
      name: The parameter, as the user spells it (named in the error).
      value: The candidate batch size.
      item_bytes: Bytes of one item as a batch holds it (every field, every step).
      what: What is sampled, for the error (e.g. "table 'uniform_table'").
      held: The most items one batch can hold whatever `value` (a pass over a table's items
        holds at most its capacity); None: `value` items (draws with replacement).

    Returns:
      The batch size as an `int`.

    Raises:
      ConfigError: If the value is not a positive integer, is above `MAX_BATCH_SIZE`, or its
        batch would need more than `BATCH_MEMORY_FRACTION` of the available memory; the
        message names the parameter, the value, the bytes needed and the ceiling.
    """
    size = require_positive_int(name, value, maximum=None)
    per_item = max(0, int(item_bytes)) + SAMPLE_INFO_BYTES
    items = size if held is None else min(size, held)
    needed = items * per_item
    of = f" of {what}" if what else ""
    batch = f"a batch of {items} items{of} ({per_item} bytes each) needs {needed} bytes"
    if size > MAX_BATCH_SIZE:
        raise ConfigError(
            f"{name}={value!r} is above the largest batch size, {MAX_BATCH_SIZE}: {batch}; "
            f"sample batches of at most {MAX_BATCH_SIZE} items"
        )
    if needed < SMALL_BATCH_BYTES:
        return size
    available = available_memory()
    if available is None:
        return size
    ceiling = int(available * BATCH_MEMORY_FRACTION)
    if needed > ceiling:
        largest = max(1, ceiling // per_item)
        raise ConfigError(
            f"{name}={value!r} is too large for this machine's memory: {batch}, above the "
            f"ceiling of {ceiling} bytes ({BATCH_MEMORY_FRACTION:g} of the {available} bytes "
            f"available: a batch is copied once more as it is built); use {name} <= {largest}"
        )
    return size
