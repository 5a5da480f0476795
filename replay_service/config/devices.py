"""The torch devices a `device=` option may name: the CPU and the accelerators this machine has.

`require_device` checks a device where it is given (a stream, a table's storage), so a device
that cannot hold data ("meta") or is not on this machine ("cuda" without CUDA, "mps" off a
Mac, "cuda:3" on a machine with one GPU) fails at the call with the devices that are there,
not at the first batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from replay_service.errors import ConfigError

if TYPE_CHECKING:  # imported where a device is checked: a replay-server loads no torch
    import torch

# Accelerator kinds torch may have, each a `torch.<kind>` module with `is_available()`.
_ACCELERATORS = ("cuda", "xpu", "mps")
_LABELS = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}


def _count(kind: str) -> int:
    """Devices of `kind` available here (0: none, or the kind is unknown to this torch)."""
    import torch

    module: Any = getattr(torch, kind, None)
    try:
        if module is None or not module.is_available():
            return 0
        counter = getattr(module, "device_count", None)
        return int(counter()) if counter is not None else 1
    except (RuntimeError, AssertionError):  # a build without that backend
        return 0


def available_devices() -> list[str]:
    """The devices data can be placed on here: "cpu", then each accelerator ("cuda:0", ...).

    Returns:
      Device names, "cpu" first.
    """
    devices = ["cpu"]
    for kind in _ACCELERATORS:
        count = _count(kind)
        devices += [kind] if kind == "mps" and count else [f"{kind}:{i}" for i in range(count)]
    return devices


def require_device(
    device: object, name: str = "device", *, kinds: Sequence[str] | None = None
) -> torch.device:
    """Checks a `device=` option: a torch device that holds data and is on this machine.

    Args:
      device: "cpu", "cuda", "cuda:1", "mps", a `torch.device`...
      name: The option, as the user spells it (named in the error).
      kinds: Device types allowed here (e.g. ("cpu", "cuda")); None: any available one.

    Returns:
      The `torch.device`, as given (e.g. "cuda" keeps no index: the current CUDA device).

    Raises:
      ConfigError: If `device` is not a torch device, is "meta" (tensors without data), is of
        a kind not in `kinds`, or is not available here; the message names the device and the
        devices available.
    """
    import torch

    try:
        target = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{name} must be a torch device such as 'cpu' or 'cuda:0', got {device!r}; "
            f"available here: {available_devices()}"
        ) from e
    available = available_devices()
    if target.type == "meta":
        raise ConfigError(
            f"{name}={device!r}: 'meta' tensors hold no data, so no batch can be placed there; "
            f"use one of the devices available here: {available}"
        )
    if kinds is not None and target.type not in kinds:
        raise ConfigError(
            f"{name}={device!r}: a device of kind {tuple(kinds)} is needed here, not "
            f"{target.type!r}; available here: {available}"
        )
    if target.type == "cpu":
        return target
    count = _count(target.type) if target.type in _ACCELERATORS else 0
    if count == 0:
        label = _LABELS.get(target.type, repr(target.type))
        raise ConfigError(
            f"{name}={device!r} was asked for, but {label} is not available here; available "
            f"here: {available}"
        )
    if target.index is not None and target.index >= count:
        raise ConfigError(
            f"{name}={device!r}: this machine has {count} {target.type!r} device"
            f"{'s' if count != 1 else ''}; available here: {available}"
        )
    return target
