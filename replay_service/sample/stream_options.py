"""The checks of a torch stream's options, made when the stream is: sizes, transitions, device

`check_sizes` checks a stream's batch size and `transitions` against its source;
`resolve_device`, `resolve_pin_memory` and `placer` say where its batches go; `require_flag`
checks the True/False options of the snapshot and recent passes. Each refuses a bad value with
a `ConfigError` naming the option and the value, never at the first batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from replay_service.config.batch_limits import require_batch_size
from replay_service.config.devices import require_device
from replay_service.errors import ConfigError
from replay_service.sample.batches import TRANSITION_SEQUENCE_LENGTH
from replay_service.specs.windows import Masked

if TYPE_CHECKING:
    from replay_service.sample.torch_streams import TorchSampleSource


def check_sizes(batch_size: int, transitions: bool, source: TorchSampleSource) -> int:
    """Checks a stream's batch size and `transitions` against its source.

    Args:
      batch_size: Items per batch (`config.batch_limits.require_batch_size`, with the bytes
        of one of the source's items: `item_bytes`).
      transitions: Whether the stream yields `TransitionBatch`es.
      source: The table sampled.

    Returns:
      The batch size as an `int`.

    Raises:
      ConfigError: If the batch size is invalid or above its ceiling, `transitions` is not a
        bool, or `transitions` is asked of padded items or of items not 2 steps long.
    """
    batch_size = require_batch_size(
        "batch_size", batch_size, item_bytes(source), what=f"table {source.table_name!r}"
    )
    if not isinstance(transitions, (bool, np.bool_)):
        raise ConfigError(f"transitions must be True or False, got {transitions!r}")
    sequence_length = source.sequence_length
    if transitions and isinstance(source.signature, Masked):
        raise ConfigError(
            f"transitions=True does not apply to table {source.table_name!r}, whose items are "
            "padded Masked(step, mask) sequences; sample them with transitions=False"
        )
    if transitions and sequence_length != TRANSITION_SEQUENCE_LENGTH:
        raise ConfigError(
            f"transitions=True needs sequence_length={TRANSITION_SEQUENCE_LENGTH} (one "
            f"transition per item), the table has sequence_length={sequence_length}; sample "
            "nested trajectories instead (transitions=False)"
        )
    return batch_size


def item_bytes(source: TorchSampleSource) -> int:
    """Bytes of one item of `source` as a batch holds it: its `item_bytes` where it has one
    (the local sources), else from its item signature (`sequence_length` steps); 0 if
    neither is known (then only the fixed ceiling of `require_batch_size` applies)."""
    known = getattr(source, "item_bytes", None)
    if known is not None:
        return int(known)
    from replay_service.specs.packed import step_layout

    try:
        return step_layout(source.signature).step_bytes * source.sequence_length
    except Exception:  # a source of another kind: its items' size is not known here
        return 0


def resolve_device(device: str | torch.device) -> torch.device:
    """The device batches are placed on (`require_device`: refused at the call if it holds no
    data or is not on this machine, never at the first batch).

    Args:
      device: "cpu", "cuda", "cuda:1" or a `torch.device`.

    Returns:
      The `torch.device`.

    Raises:
      ConfigError: If the device is unknown or not on this machine.
    """
    return require_device(device)


def resolve_pin_memory(pin_memory: bool) -> bool:
    """Whether batches are pinned: `pin_memory`, but False (with a warning, as `DataLoader`
    does) when no accelerator is available.

    Args:
      pin_memory: The stream's option.

    Returns:
      Whether to pin.
    """
    if pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "pin_memory=True but no accelerator is available; batches are not pinned",
            stacklevel=3,
        )
        return False
    return bool(pin_memory)


def placer(device: torch.device, pin: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a stream applies to every tensor to place it: pinning, then the (asynchronous
    when pinned) transfer to `device`.

    Args:
      device: Where the batches go.
      pin: Pin host memory first.

    Returns:
      The function, or None when there is nothing to do (the CPU, unpinned).
    """
    if device.type == "cpu" and not pin:
        return None

    def place(tensor: torch.Tensor) -> torch.Tensor:
        if pin:
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=pin)

    return place


def require_flag(name: str, value: object) -> bool:
    """Checks a True/False option: a `bool` (not 0, 1 or a numpy bool).

    Args:
      name: The option, as the user spells it (named in the error).
      value: The candidate value.

    Returns:
      The value.

    Raises:
      ConfigError: "<name> must be True or False, got <value>".
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value
