"""What the store asks of a backend's checkpoint files: `CheckpointFormat`, and the registry.

The store (`storage.store`) writes, verifies, adopts and loads checkpoints without knowing any
backend's files. Each backend describes its own with one `CheckpointFormat` object
(`backends.reverb.internals.CHECKPOINT_FORMAT`, `backends.local.checkpoint.CHECKPOINT_FORMAT`),
and `replay_service.backends` registers both when it is imported (`register`; every backend
module is imported through it), local first. A `CheckpointStore` asks the formats it was given,
or else the registered ones (`registered`), in that order: the first that owns a directory's
files verifies it (`verify_checkpoint`) and is recorded as its writer (`backend_of_files`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from replay_service.errors import CheckpointError
from replay_service.storage.files import DONE_FILE, is_done

Verified = tuple[int, dict[str, dict[str, Any]]]
"""What a finished checkpoint reads back as: `(num_items, files)`, the items of every table
and, per file, its "size" and "sha256"."""


class CheckpointFormat(Protocol):
    """One backend's checkpoint files, as the store needs to know them.

    Attributes:
      backend: The backend that writes them ("reverb", "local"): recorded with each checkpoint
        and named when a buffer of another backend meets one.
      settle_s: Seconds after `DONE` during which the writer of a staged checkpoint may still
        touch the staging root; a checkpoint that a client requested is adopted only after
        the longest of these (0 where the writer is done once it returns).
    """

    @property
    def backend(self) -> str:
        """The backend that writes checkpoints of this format."""
        ...

    @property
    def settle_s(self) -> float:
        """Seconds after `DONE` until a staged checkpoint of this format may be moved."""
        ...

    def owns(self, names: Collection[str]) -> bool:
        """Whether a checkpoint holding files named `names` is of this format."""
        ...

    def verify(self, path: str) -> Verified:
        """Reads the finished checkpoint `path` back in full.

        Raises:
          CheckpointError: If it is incomplete or damaged; the message names the file.
        """
        ...


_REGISTERED: list[CheckpointFormat] = []


def register(checkpoint_format: CheckpointFormat) -> None:
    """Adds a backend's checkpoint format to those every store asks by default (once per
    backend name; a second registration of a name replaces the first in place).

    Args:
      checkpoint_format: The backend's format.
    """
    for index, known in enumerate(_REGISTERED):
        if known.backend == checkpoint_format.backend:
            _REGISTERED[index] = checkpoint_format
            return
    _REGISTERED.append(checkpoint_format)


def registered() -> tuple[CheckpointFormat, ...]:
    """The registered checkpoint formats, in the order they were registered."""
    return tuple(_REGISTERED)


def format_of(
    formats: Sequence[CheckpointFormat], names: Collection[str]
) -> CheckpointFormat | None:
    """The first of `formats` that owns files named `names`, or None."""
    return next((f for f in formats if f.owns(names)), None)


def backend_of_files(formats: Sequence[CheckpointFormat], names: Collection[str]) -> str | None:
    """The backend whose checkpoint holds files named `names` (see `format_of`), or None."""
    owner = format_of(formats, names)
    return None if owner is None else owner.backend


def verify_checkpoint(formats: Sequence[CheckpointFormat], path: str) -> Verified:
    """Reads the finished checkpoint `path` back with the format that owns its files.

    Returns:
      `(num_items, files)`: items of every table, and per file its size and SHA-256.

    Raises:
      CheckpointError: If it is incomplete or damaged, or none of `formats` owns its files;
        the message names the path or file.
    """
    try:
        names = os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint {path!r}: {e}") from e
    owner = format_of(formats, names)
    if owner is not None:
        return owner.verify(path)
    if not is_done(path):
        raise CheckpointError(f"checkpoint {path!r} is incomplete (no {DONE_FILE} file)")
    known = ", ".join(f.backend for f in formats) or "none given"
    raise CheckpointError(
        f"checkpoint {path!r} holds no files of a known checkpoint format ({known}): "
        f"{sorted(names)}"
    )
