"""What `populate` checks before it builds anything, without TensorFlow: paths, sizes, env id.

The output directory, an existing buffer of that name, the sizes, the capacity and the
environment id (in gym's registry) are checked without loading TensorFlow or TF-Agents.

`filling._make_plan` runs `check_target` first, and `replay-populate` runs it before it imports
TensorFlow, so a refusal that needs no TensorFlow answers at once, in the same words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

from replay_service.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    NoCheckpointError,
)
from replay_service.starter.envs import check_env_id
from replay_service.starter.naming import SUMMARY_PLOT_SUFFIX, starter_buffer_path
from replay_service.starter.options import (
    DEFAULT_CAPACITY,
    DEFAULT_SEQUENCE_LENGTH,
    PopulateConfig,
    check_capacity,
    max_new_items,
)
from replay_service.starter.staging import check_own_entries
from replay_service.storage.metadata import StoreMetadata
from replay_service.storage.store import CheckpointStore


@dataclasses.dataclass(frozen=True)
class PopulateTarget:
    """Where a checked `PopulateConfig` writes, and the sizes of its buffer.

    Attributes:
      output_dir: The absolute output directory.
      path: The buffer's final path, `<output_dir>/<buffer_name>`.
      plot_path: Its summary plot, beside it.
      stored: The metadata of the existing buffer that is replaced or extended, else None.
      capacity: The buffer's capacity: the config's (or the default), the stored one to append.
      sequence_length: Steps per item, resolved as `capacity` is.
    """

    output_dir: str
    path: str
    plot_path: str
    stored: StoreMetadata | None
    capacity: int
    sequence_length: int


def describe_collection(config: PopulateConfig) -> str:
    """What `config` collects, e.g. "1 env(s) x 2 run(s) x 30 steps", for messages."""
    c = config
    return f"{c.num_envs} env(s) x {c.num_runs} run(s) x {c.steps_per_run} steps"


def check_target(config: PopulateConfig) -> PopulateTarget:
    """Checks everything about `config` that needs neither TensorFlow nor writing: the output
    directory, an existing buffer of that name, the sizes, the capacity and the env id.

    Args:
      config: What to collect and where.

    Returns:
      Where the buffer goes and its resolved sizes.

    Raises:
      ConfigError: If the sizes contradict the buffer appended to, the capacity is too small
        to keep every run, or the environment id is unknown.
      CheckpointExistsError: If the buffer exists and neither `overwrite` nor `append` is set.
      NoCheckpointError: If `append` is set and there is no complete buffer to add to.
      CheckpointError: If the output directory cannot be written or holds a foreign
        directory of that name.
    """
    output_dir = os.path.abspath(config.output_dir)
    path = starter_buffer_path(output_dir, config.buffer_name)
    _check_output_dir(output_dir)
    stored = _check_existing(path, config)
    capacity, sequence_length = _resolve_sizes(config, stored, path)
    new_items = max_new_items(config.total_steps, sequence_length)
    check_capacity(capacity, 0, new_items, describe_collection(config))
    with env_errors(config.env):
        check_env_id(config.env)
    return PopulateTarget(
        output_dir=output_dir,
        path=path,
        plot_path=path + SUMMARY_PLOT_SUFFIX,
        stored=stored,
        capacity=capacity,
        sequence_length=sequence_length,
    )


@contextlib.contextmanager
def env_errors(name: str) -> Iterator[None]:
    """Turns what checking or creating the environment `name` raises into a `ConfigError`.

    Raises:
      ConfigError: For an unknown id (the `ValueError` of `load_env`, same message) or any
        other failure (named with its type).
    """
    try:
        yield
    except ValueError as e:
        raise ConfigError(str(e)) from e
    except Exception as e:
        raise ConfigError(f"cannot create environment {name!r}: {type(e).__name__}: {e}") from e


def _check_output_dir(output_dir: str) -> None:
    """Checks, without writing, that `output_dir` is (or can be created as) a writable dir."""
    existing = output_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        blocker = "" if existing == output_dir else f" ({existing!r} is a file)"
        raise CheckpointError(f"output dir {output_dir!r} is not a directory{blocker}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"output dir {output_dir!r} is not writable ({existing!r})")


def _check_existing(final: str, config: PopulateConfig) -> StoreMetadata | None:
    """Returns the metadata of an existing buffer that may be replaced or extended, else None."""
    if not os.path.lexists(final) or (os.path.isdir(final) and not os.listdir(final)):
        if config.append:
            raise NoCheckpointError(f"there is no starter buffer {final!r} to append to")
        return None
    store = CheckpointStore(final)
    metadata = store.read_metadata()
    if not (config.overwrite or config.append):
        raise CheckpointExistsError(
            f"starter buffer {final!r} already exists and is never modified silently; pass "
            "--overwrite (overwrite=True) to replace it, --append (append=True) to add to it, or "
            "choose another buffer name"
        )
    check_own_entries(final)
    if config.append and store.latest() is None:
        raise NoCheckpointError(f"starter buffer {final!r} holds no complete checkpoint")
    return metadata


def _resolve_sizes(
    config: PopulateConfig, stored: StoreMetadata | None, final: str
) -> tuple[int, int]:
    """Returns `(capacity, sequence_length)`: the config's, or the stored ones when appending."""
    if not config.append or stored is None:
        return (
            config.capacity or DEFAULT_CAPACITY,
            config.sequence_length or DEFAULT_SEQUENCE_LENGTH,
        )
    for name in ("capacity", "sequence_length"):
        requested, kept = getattr(config, name), getattr(stored, name)
        if requested is not None and requested != kept:
            raise ConfigError(
                f"cannot append to {final!r} with {name} {requested}: the buffer has {name} "
                f"{kept} (leave it out to use the buffer's)"
            )
    return stored.capacity, stored.sequence_length
