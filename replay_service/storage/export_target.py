"""Where an export goes: its two files, confined to one directory, and that directory's checks

An export holds one table (`require_one_table`) in two files, `<prefix>state.safetensors` and
`<prefix>metadata.json`, in one directory (`export_paths`); it is written into an empty
directory, or over the export files of a non-empty one only when asked to (`check_target`).
The files' contents are `storage.export`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError, CheckpointExistsError, ConfigError

DEFAULT_PREFIX = "buffer_"
STATE_SUFFIX = "state.safetensors"
METADATA_SUFFIX = "metadata.json"


def export_paths(dirpath: str | os.PathLike[str], prefix: str = DEFAULT_PREFIX) -> tuple[str, str]:
    """Returns `(state_path, metadata_path)` of an export, confined to `dirpath`.

    Raises:
      ConfigError: If `prefix` could name a file outside `dirpath` (a path separator or ".."),
        or `prefix` or `dirpath` holds a NUL character (no file name can).
    """
    if (
        not isinstance(prefix, str)
        or "/" in prefix
        or os.sep in prefix
        or ".." in prefix
        or "\0" in prefix
    ):
        raise ConfigError(
            "prefix must be a plain file-name prefix without '/', '..' or NUL characters, "
            f"got {prefix!r}"
        )
    root = os.fspath(dirpath)
    if "\0" in (root if isinstance(root, str) else root.decode("utf-8", "replace")):
        raise ConfigError(f"export directory {root!r} holds a NUL character; no path can")
    return (
        os.path.join(root, f"{prefix}{STATE_SUFFIX}"),
        os.path.join(root, f"{prefix}{METADATA_SUFFIX}"),
    )


def check_target(dirpath: str, overwrite: bool) -> None:
    """Checks that an export may be written into `dirpath`.

    Args:
      dirpath: The export directory (it may not exist yet).
      overwrite: Whether the export files of a non-empty directory may be replaced.

    Raises:
      CheckpointError: If `dirpath` exists and is not a directory.
      CheckpointExistsError: If `dirpath` is not empty and `overwrite` is False.
    """
    if os.path.exists(dirpath) and not os.path.isdir(dirpath):
        raise CheckpointError(f"export directory {dirpath!r} exists and is not a directory")
    entries = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointExistsError(
            f"export directory {dirpath!r} is not empty (it contains: {shown}); choose an empty "
            "directory, or pass overwrite=True to replace the export files (other files are kept)"
        )


def require_one_table(tables: Sequence[TableConfig], what: str) -> None:
    """Refuses a buffer with extra tables: an export holds one table.

    Raises:
      ConfigError: If `tables` holds more than one table.
    """
    names = [t.name for t in tables]
    if len(names) > 1:
        raise ConfigError(
            f"{what} supports a buffer of one table; this manager has tables {names}. Use a "
            "manager without extra_tables (checkpoints keep every table)"
        )
