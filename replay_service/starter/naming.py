"""Starter buffer names and paths: `<output_dir>/<name>` and its summary plot beside it."""

from __future__ import annotations

import os

from replay_service.errors import ConfigError

SUMMARY_PLOT_SUFFIX = ".summary.png"
MAX_BUFFER_NAME_LENGTH = 200


def validate_buffer_name(name: object) -> str:
    """Checks that a starter buffer name is a single, visible directory name.

    Args:
      name: The candidate name.

    Returns:
      The name, unchanged.

    Raises:
      ConfigError: If the name is not a string, is empty, contains a path separator or a NUL
        character, starts with '.' (which also rules out '.' and '..'), ends with
        `SUMMARY_PLOT_SUFFIX`, or is longer than `MAX_BUFFER_NAME_LENGTH`.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"buffer name must be a non-empty string, got {name!r}")
    separators = [s for s in (os.sep, os.altsep, "/", "\\", "\0") if s and s in name]
    if separators:
        raise ConfigError(
            f"buffer name {name!r} must be a single directory name, without {separators[0]!r}"
        )
    if name.startswith("."):
        raise ConfigError(
            f"buffer name {name!r} must not start with '.' ('.' and '..' are not names, and "
            "hidden names are reserved for unfinished buffers)"
        )
    if name.endswith(SUMMARY_PLOT_SUFFIX):
        raise ConfigError(
            f"buffer name {name!r} must not end with {SUMMARY_PLOT_SUFFIX!r}, the suffix of "
            "summary plots"
        )
    if len(name) > MAX_BUFFER_NAME_LENGTH:
        raise ConfigError(
            f"buffer name {name[:20]!r}... is {len(name)} characters long; the limit is "
            f"{MAX_BUFFER_NAME_LENGTH}"
        )
    return name


def starter_buffer_path(output_dir: str | os.PathLike[str], buffer_name: str) -> str:
    """Returns the absolute path of the starter buffer `buffer_name` in `output_dir`.

    Raises:
      ConfigError: If the name is not valid (see `validate_buffer_name`).
    """
    return os.path.join(os.path.abspath(os.fspath(output_dir)), validate_buffer_name(buffer_name))


def summary_plot_path(output_dir: str | os.PathLike[str], buffer_name: str) -> str:
    """Returns the path of the summary plot written beside the starter buffer.

    Raises:
      ConfigError: If the name is not valid (see `validate_buffer_name`).
    """
    return starter_buffer_path(output_dir, buffer_name) + SUMMARY_PLOT_SUFFIX
