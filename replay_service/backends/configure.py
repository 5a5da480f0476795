"""How a manager's arguments become a backend: `configure` checks them in order and returns the
`Backend` class and the `BackendOptions` it is built from; `configure_spaces` turns
`ReplayBufferManager.from_spaces`'s gymnasium spaces into a data spec and a backend name."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from replay_service.backends import (
    backend_class,
    choose_backend,
    resolve_auto,
    resolve_auto_layout,
)
from replay_service.backends.base import Backend, BackendOptions
from replay_service.config.options import (
    SamplingConfig,
    TableConfig,
    Timeouts,
    require_number,
    validate_manager_options,
    validate_path,
)
from replay_service.config.tables import check_extra_tables
from replay_service.errors import ConfigError
from replay_service.specs import nests as specs
from replay_service.specs import sizes
from replay_service.specs import windows as sequences
from replay_service.specs.frames import check_frame_stack
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.layouts import AUTO, NESTED


def configure(
    data_spec: Any,
    capacity: int,
    checkpoint_dir: str | os.PathLike[str] | None,
    sequence_length: int,
    *,
    table_name: str,
    sampling: SamplingConfig | None,
    server_address: str | None,
    port: int | None,
    timeouts: Timeouts | None,
    keep_checkpoints: int,
    stride_length: int,
    extra_tables: Sequence[TableConfig],
    pad_end_of_episode: bool,
    checkpoint_interval_s: float | None,
    backend: str,
    storage: str,
    layout: str,
    seed: int | None,
    device: str | None,
    frame_stack: int | None = None,
    frame_axis: int = 0,
    compression: str | None = None,
) -> tuple[type[Backend], BackendOptions]:
    """Checks `ReplayBufferManager`'s backend arguments (documented there), in order: the
    backend and layout names, the tables, the integers, the data spec, the directory and
    interval, then the options the chosen backend takes (`Backend.check_options`). Nothing is
    created or written.

    Returns:
      The `Backend` implementation and the options to build it `from_options`.

    Raises:
      ConfigError: Naming the first invalid argument and its value.
      SpecMismatchError: If `data_spec` is not a TF-Agents `Trajectory` of tensor specs.

    `frame_stack` (local backend) is checked after the data spec (`frames.check_frame_stack`)
    and given to every table.
    """
    implementation = backend_class(
        resolve_auto(backend, checkpoint_dir=checkpoint_dir, server_address=server_address),
        server_address,
    )
    name = resolve_auto_layout(
        layout,
        kind=implementation.kind,
        checkpoint_dir=checkpoint_dir,
        server_address=server_address,
    )
    table = TableConfig(
        name=table_name,
        capacity=capacity,
        sequence_length=sequence_length,
        sampling=sampling or SamplingConfig(),
        pad_end_of_episode=pad_end_of_episode,
        layout=name,
    )
    extra = check_extra_tables(table, _with_layout(extra_tables, name))
    validate_manager_options(
        port=port, stride_length=stride_length, keep_checkpoints=keep_checkpoints
    )
    specs.check_collect_spec(data_spec, "ReplayBufferManager")
    if frame_stack is not None or frame_axis != 0:
        table, extra = _with_frames(
            implementation,
            data_spec,
            frame_stack,
            frame_axis,
            pad_end_of_episode,
            server_address,
            (table, *extra),
        )
    stored_spec = sequences.stored_spec(data_spec, pad_end_of_episode)
    specs.describe_spec(data_spec)  # refuses a spec that is not a nest of tensor specs
    # Before anything is allocated (the local backend checks its whole rings on create).
    sizes.check_item_fits(specs.describe_spec(stored_spec), (table, *extra))
    # A layout the stored spec cannot take is refused before anything is created (the Reverb
    # backend resolves the tables' layout again: `backends.reverb.backend.options_layout`).
    resolve_layout(
        name,
        stored_spec,
        frame_stack=table.frame_stack if implementation.kind == "reverb" else None,
        frame_axis=table.frame_axis,
    )
    if server_address is None and checkpoint_dir is None:
        raise ConfigError("checkpoint_dir is required unless server_address is given")
    if checkpoint_dir is not None:
        checkpoint_dir = validate_path(checkpoint_dir, "checkpoint_dir")
    _check_interval(checkpoint_interval_s, server_address)
    options = BackendOptions(
        tables=(table, *extra),
        data_spec=data_spec,
        stored_spec=stored_spec,
        timeouts=timeouts or Timeouts(),
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=keep_checkpoints,
        checkpoint_interval_s=checkpoint_interval_s,
        port=port,
        server_address=server_address,
        storage=storage,
        seed=seed,
        device=device,
        compression=compression,
        # "auto" on a remote server: its tables' layout, taken on connecting.
        layout_from_server=layout == AUTO and server_address is not None,
    )
    implementation.check_options(
        {
            "storage": storage,
            "layout": name,
            "port": port,
            "seed": seed,
            "device": device,
            "compression": compression,
        }
    )
    return implementation, options


def configure_spaces(
    observation_space: Any,
    action_space: Any,
    extras: Mapping[str, Any] | None,
    backend: str,
    checkpoint_dir: str | os.PathLike[str] | None,
    options: Mapping[str, Any],
) -> tuple[Any, str]:
    """The data spec of `ReplayBufferManager.from_spaces` (`specs.nests.data_spec_for_spaces`)
    and what its `backend` means there (`resolve_auto` at the single-process door); the
    arguments are documented there, `options` being its other keyword arguments. On the local
    backend the spec is an `array_specs.Trajectory` of `ArraySpec`, so that door imports no
    TensorFlow or TF-Agents.

    Returns:
      The data spec and the backend name.

    Raises:
      ConfigError: For an unsupported space or a bad extra, naming it and its value.
    """
    chosen = resolve_auto(
        backend,
        checkpoint_dir=checkpoint_dir,
        server_address=options.get("server_address"),
        single_process=True,
        options=options,
    )
    if chosen == "reverb" or options.get("server_address") is not None:
        # Refused here, naming why, before its TF spec needs TensorFlow.
        choose_backend(chosen, options.get("server_address"))
    # The local backend's door imports no TensorFlow: its spec is an `array_specs.Trajectory`
    # (a checkpoint's description is the same for either kind of spec). Reverb gets TF specs;
    # an unresolved "auto" gets them where TF-Agents imports (Reverb, where it imports too).
    spec_type: specs.SpecType = {"local": "array", "reverb": "tf"}.get(chosen, "auto")
    data_spec = specs.data_spec_for_spaces(
        observation_space, action_space, spec_type, extras=extras
    )
    return data_spec, chosen


def _with_layout(extra_tables: Any, layout: str) -> Any:
    """`extra_tables` with the manager's layout where they left the default: every table of a
    buffer has one layout (anything that is not a sequence is left to `check_extra_tables`)."""
    if layout == NESTED or not isinstance(extra_tables, Sequence) or isinstance(extra_tables, str):
        return extra_tables
    return [
        dataclasses.replace(t, layout=layout)
        if isinstance(t, TableConfig) and t.layout == NESTED
        else t
        for t in extra_tables
    ]


def _with_frames(
    implementation: type[Backend],
    data_spec: Any,
    frame_stack: Any,
    frame_axis: Any,
    pad_end_of_episode: bool,
    server_address: str | None,
    tables: Sequence[TableConfig],
) -> tuple[TableConfig, tuple[TableConfig, ...]]:
    """The tables with the frame stack (`frames.check_frame_stack`), every table's.

    Raises:
      ConfigError: Naming the value: an invalid frame stack, a remote Reverb server
        (`server_address`), or `pad_end_of_episode` (its `Masked` steps are not stacked).
    """
    check_frame_stack(data_spec, frame_stack, frame_axis)
    if frame_stack is None:
        raise ConfigError(f"frame_axis={frame_axis!r} needs frame_stack (an integer >= 2)")
    if implementation.kind not in ("local", "reverb") or server_address is not None:
        raise ConfigError(
            f"frame_stack={frame_stack!r} (frames stored once) needs backend='local' or an "
            f"embedded Reverb server, got server_address={server_address!r}: store the "
            "stacks whole there (no frame_stack)"
        )
    if pad_end_of_episode:
        raise ConfigError(
            f"frame_stack={frame_stack!r} does not take pad_end_of_episode=True (padded steps "
            "are not frame stacks); use pad_end_of_episode=False"
        )
    framed = [
        dataclasses.replace(t, frame_stack=int(frame_stack), frame_axis=int(frame_axis))
        for t in tables
    ]
    return framed[0], tuple(framed[1:])


def _check_interval(interval: float | None, server_address: str | None) -> None:
    if interval is None:
        return
    if server_address is not None:
        raise ConfigError(
            f"checkpoint_interval_s={interval!r} applies only to the embedded server; a remote "
            "server checkpoints on its own schedule (replay-server --checkpoint_interval_s)"
        )
    require_number("checkpoint_interval_s (seconds, or None)", interval, 0, positive=True)
