"""Emphasizing recent experience (ERE, Wang & Ross 2019): sampling only the newest items.

After each episode an ERE learner makes `K` updates; update `k` (0-based) samples its batch
uniformly from the newest `c_k` items of the buffer, where

    c_k = max(N * eta ** (k * 1000 / K), c_min)

(capped at `N`), `N` the number of items the table holds when the batch is drawn, `eta` in
(0, 1] (1: plain uniform sampling over everything; the paper uses 0.994..0.999) and `c_min`
the smallest window (pytorchrl's `EREBuffer(eta=, cmin=)`; the paper's c_min is 2500). Early
updates of a round see most of the buffer, later ones mostly recent data.

`RecentBatches` is what `ReplayBufferManager.recent_batches` returns. The items are read from
the live table (a read, not a sample: `times_sampled`, rate limiting and `max_times_sampled`
removals are untouched), so items written between two batches are in the next one's window.
It needs `Capability.RECENT_SAMPLING` (the local backend): a Reverb table's samplers draw from
the whole table, or give only its newest or oldest item, and none restricts sampling to a
window whose size changes with every update.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from replay_service.config.options import require_positive_int, require_seed
from replay_service.errors import BufferStateError, ConfigError
from replay_service.sample.batches import TRANSITION_SEQUENCE_LENGTH, Packer, stream_packer
from replay_service.sample.stream_options import require_flag, resolve_device
from replay_service.specs.windows import Masked

if TYPE_CHECKING:
    from replay_service.sample.view import SampleView

DEFAULT_ETA = 0.996
"""The paper's initial eta."""
DEFAULT_C_MIN = 5000
"""pytorchrl's default `cmin`."""


def ere_window(num_items: int, update: int, num_updates: int, eta: float, c_min: int) -> int:
    """The number of newest items update `update` of `num_updates` samples from.

    Args:
      num_items: Items in the table (N).
      update: The update's index k, 0-based.
      num_updates: Updates in the round (K).
      eta: ERE's eta, in (0, 1].
      c_min: The smallest window.

    Returns:
      `min(N, max(int(N * eta ** (k * 1000 / K)), c_min))`.
    """
    window = max(int(num_items * eta ** (update * 1000 / num_updates)), c_min)
    return min(num_items, window)


class RecentOptions(NamedTuple):
    """The options of a round of ERE batches, checked (`check_options` returns them).

    Attributes:
      batch_size: Items per batch.
      num_updates: Batches per round (K).
      eta: ERE's eta, in (0, 1].
      c_min: The smallest window.
      seed: Seed of the draws; None draws fresh ones.
      transitions: Yield `TransitionBatch`es (tables of 2-step, unpadded items).
    """

    batch_size: int
    num_updates: int
    eta: float
    c_min: int
    seed: int | None
    transitions: bool


def check_options(
    batch_size: Any, num_updates: Any, eta: Any, c_min: Any, seed: Any, transitions: Any
) -> RecentOptions:
    """Refuses bad `recent_batches` options.

    Returns:
      The options, sizes as `int` and `eta` as `float`.

    Raises:
      ConfigError: Naming the option and its value.
    """
    batch_size = require_positive_int("batch_size", batch_size, maximum=None)
    num_updates = require_positive_int("num_updates", num_updates, maximum=None)
    c_min = require_positive_int("c_min", c_min, maximum=None)
    if (
        not isinstance(eta, numbers.Real)
        or isinstance(eta, bool)
        or not math.isfinite(eta)
        or not 0 < eta <= 1
    ):
        raise ConfigError(f"eta must be a number in (0, 1], got {eta!r}")
    require_seed("seed", seed)
    require_flag("transitions", transitions)
    return RecentOptions(batch_size, num_updates, float(eta), c_min, seed, transitions)


class RecentBatches:
    """`num_updates` batches, batch `k` drawn from the newest `ere_window(N, k, K, ...)` items.

    Iterating yields `num_updates` batches, each what `torch_batches` yields without
    `with_info`: the item nest of torch tensors `[batch, sequence_length, ...]`, or a
    `TransitionBatch` with `transitions=True`. `windows` lists the window of every batch
    yielded so far in the current iteration. Each `iter()` is a new round (`k` starts at 0);
    with a `seed`, a round on the same items repeats the same batches.

    Args:
      read: `read(batch_size, window, rng)`: one torch tensor per field of `batch_size` items
        drawn uniformly from the newest `window` items.
      size: The number of items in the table now.
      structure: The per-step stored spec.
      options: The round's sizes and flags, checked (`check_options`).
      device: Torch device of the batches.
      table_name: The table read (for error messages).
      sequence_length: The table's steps per item.

    Raises:
      ConfigError: If the device is invalid or `transitions` does not apply to the items.
    """

    def __init__(
        self,
        read: Callable[[int, int, np.random.Generator], list[torch.Tensor]],
        size: Callable[[], int],
        structure: Any,
        options: RecentOptions,
        *,
        device: str | torch.device = "cpu",
        table_name: str = "",
        sequence_length: int = TRANSITION_SEQUENCE_LENGTH,
    ) -> None:
        self._device = resolve_device(device)
        if options.transitions and (
            isinstance(structure, Masked) or sequence_length != TRANSITION_SEQUENCE_LENGTH
        ):
            raise ConfigError(
                f"transitions=True needs unpadded items of {TRANSITION_SEQUENCE_LENGTH} steps; "
                f"table {table_name!r} has sequence_length={sequence_length}"
                f"{' and Masked (padded) items' if isinstance(structure, Masked) else ''}; "
                "use transitions=False"
            )
        self._read = read
        self._size = size
        self.batch_size = options.batch_size
        self.num_updates = options.num_updates
        self.eta = options.eta
        self.c_min = options.c_min
        self.seed = options.seed
        self.table_name = table_name
        self.windows: list[int] = []
        self._packer: Packer = stream_packer(structure, options.transitions)

    def __len__(self) -> int:
        """Batches per round: `num_updates`."""
        return self.num_updates

    def __iter__(self) -> Iterator[Any]:
        rng = np.random.default_rng(self.seed)
        self.windows = []
        for update in range(self.num_updates):
            num_items = self._size()
            if num_items <= 0:
                raise BufferStateError(f"table {self.table_name!r} holds no items to sample")
            window = ere_window(num_items, update, self.num_updates, self.eta, self.c_min)
            flat = self._read(self.batch_size, window, rng)
            if self._device.type != "cpu":
                flat = [t.to(self._device) for t in flat]
            self.windows.append(window)
            yield self._packer(flat)


def recent_batches(
    view: SampleView,
    batch_size: int,
    num_updates: int,
    eta: float = DEFAULT_ETA,
    c_min: int = DEFAULT_C_MIN,
    seed: int | None = None,
    transitions: bool = False,
    device: str | torch.device = "cpu",
    table: str | None = None,
) -> RecentBatches:
    """One round of ERE batches of one table of the buffer (`RecentBatches`).

    `N` is the table's size when each batch is drawn (`view.count`, which flushes the
    collectors); the items are read, not sampled (`Backend.newest_reader`).

    Args:
      view: The buffer.
      batch_size: Items per batch.
      num_updates: Batches in the round (K).
      eta: ERE's eta, in (0, 1].
      c_min: The smallest window, in items.
      seed: Seed of the draws; None draws fresh ones.
      transitions: Yield `TransitionBatch`es.
      device: Torch device of the batches.
      table: The table read; None: the primary one.

    Returns:
      The round's batches.

    Raises:
      ConfigError: If an option is invalid (`check_options`; the batch size and device as
        `torch_batches`), `table` is unknown, or the backend cannot read the newest items
        (after the buffer is required).
      BufferStateError: If the buffer was not created or loaded.
    """
    options = check_options(batch_size, num_updates, eta, c_min, seed, transitions)
    config = view.table(table)
    view.check_batches(config, batch_size, device)
    view.require_buffer()
    read = view.backend.newest_reader(config, f"recent_batches(eta={eta!r}, c_min={c_min!r})")
    return RecentBatches(
        read,
        lambda: view.count(config.name),
        view.stored_spec,
        options,
        device=device,
        table_name=config.name,
        sequence_length=config.sequence_length,
    )
