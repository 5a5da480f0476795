"""How large a local table's step ring is made (`ring_steps`), and whether the rings of a
buffer's tables fit where they would live, checked before any exists (`check_tables_fit`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from replay_service.backends.local.codecs import COMPRESS_MIN_BYTES, estimated_bytes
from replay_service.backends.local.scratch import check_free, scratch_file_bytes
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs import sizes


def ring_steps(capacity: int, sequence_length: int, frame_stack: int | None = None) -> int:
    """Steps of a table's step ring when it is made, in RAM or in files ("memmap") alike:
    `capacity + sequence_length - 1` (windows of one writer share steps; the ring grows if
    writers interleave, `ring.StepRing._claim`). Stacked observations (`frame_stack` K): an
    item also needs its first step's K-1 earlier frames, K-1 steps more."""
    span = sequence_length + (frame_stack - 1 if frame_stack else 0)
    return capacity + span - 1


def _step_bytes(
    config: TableConfig, fields: Sequence[dict[str, Any]], compression: str | None = None
) -> int:
    """Bytes a table stores per step: every field, a stacked observation's newest frame only
    and the serials of its earlier frames (`frames.FrameStack`); with `compression`, the
    fields stored compressed (a stacked observation's frames, every field of at least
    `COMPRESS_MIN_BYTES`) at `codecs.estimated_bytes`."""
    total = 0
    for field in sizes.field_sizes(fields):
        nbytes = _field_bytes(config, field)
        if compression is not None and (
            nbytes >= COMPRESS_MIN_BYTES or (config.frame_stack and field.path == "observation")
        ):
            nbytes = estimated_bytes(nbytes, compression)
        total += nbytes
    if config.frame_stack:
        total += 8 * (config.frame_stack - 1)
    return total


def _field_bytes(config: TableConfig, field: sizes.FieldSize) -> int:
    """Bytes a table stores per step of `field`: a stacked observation's newest frame."""
    if config.frame_stack and field.path == "observation":
        return field.nbytes // config.frame_stack
    return field.nbytes


def check_tables_fit(
    configs: Sequence[TableConfig],
    fields: Sequence[dict[str, Any]],
    storage: str,
    scratch_root: str,
    compression: str | None = None,
) -> None:
    """Refuses tables whose step rings cannot fit where they would live, before any exists.

    `storage="memory"`: the rings' bytes (`ring_steps` x the step's bytes, every table) must
    fit in the memory available (`sizes.available_memory`); RAM pages are committed as steps
    are written, so a ring too large would be accepted and the process killed once it fills.
    With `compression`, a compressed field's step is counted at the codec's estimate
    (`codecs.estimated_bytes`: an eighth of its raw bytes plus `codecs.SLOT_OVERHEAD`, about
    twice what Atari frames take with "lz4" or "zstd"; "none" at its raw bytes); payloads that
    outgrow the estimate are refused at the insert that does not fit
    (`ring.StepRing._check_payload_room`), before it changes anything.
    "memmap": every table's files, the same `ring_steps` x the step's bytes, must fit on the
    disk of `scratch_root` (`scratch.check_free`, which `reserve_files` applies again to each
    table's files when they are made; a ring that grows later takes its larger files then, or
    evicts its oldest items where the disk cannot hold them, see `ring`). Unknown amounts
    (another platform) pass.

    Args:
      configs: The tables (capacity, sequence length, name).
      fields: `specs.describe_spec(stored_spec)` of one step.
      storage: "memory" or "memmap".
      scratch_root: `<checkpoint_dir>/.memmap` (it may not exist yet), for "memmap".
      compression: The tables' codec (`codecs.CODECS`, "memory" only); None: uncompressed.

    Raises:
      ConfigError: Naming the bytes per step and the largest fields with their shapes, each
        table's steps, the total and the bytes available.
    """
    rings = [(c.name, ring_steps(c.capacity, c.sequence_length, c.frame_stack), c) for c in configs]
    if storage == "memmap":
        files = [
            (
                os.path.join(scratch_root, name, f"field{index}.memmap"),
                steps * _field_bytes(config, field),
            )
            for name, steps, config in rings
            for index, field in enumerate(sizes.field_sizes(fields))
        ]
        names = ", ".join(repr(name) for name, _, _ in rings)
        # An earlier buffer's files there are deleted before the new ones are reserved.
        reclaimable = sum(scratch_file_bytes(os.path.join(scratch_root, n)) for n, _, _ in rings)
        what = f"the memory-mapped storage of tables {names}"
        check_free(files, what, fields, scratch_root, reclaimable)
        return
    available = sizes.available_memory()
    total = sum(steps * _step_bytes(config, fields, compression) for _, steps, config in rings)
    if available is None or total <= available:
        return
    per_step = _step_bytes(configs[0], fields, compression)
    tables = "; ".join(
        f"table {name!r}: {steps} steps for capacity {config.capacity}"
        + (f", frames stored once (frame_stack={config.frame_stack})" if config.frame_stack else "")
        for name, steps, config in rings
    )
    if compression is not None:
        tables += (
            f"; large fields compressed ({compression!r}), counted at an estimated "
            "1/8 of their raw bytes each"
            if compression != "none"
            else f"; large fields stored as payloads ({compression!r}) at their raw bytes"
        )
    raise ConfigError(
        f"the local tables need {total} bytes ({sizes.human(total)}) of memory "
        f"(storage='memory'), but {available} bytes ({sizes.human(available)}) are available: "
        f"{per_step} bytes per step ({tables}); the largest fields per step: "
        f"{sizes.largest_fields(fields)}. Nothing was allocated: lower the capacity or the "
        "field's shape, or use storage='memmap' (the rings in files on the disk of "
        "checkpoint_dir)"
    )
