"""Epoch passes over a buffer: every stored item exactly once per epoch, in shuffled batches.

What on-policy learners (PPO's `num_epochs` x `num_mini_batch` updates) and pytorchrl's
`generate_batches(num_mini_batch, mini_batch_size, num_epochs)` do with a rollout: each epoch
draws a fresh random permutation of the items and cuts it into batches of `batch_size` (the
last one shorter unless `drop_last`). Sampling a Reverb table cannot do this (it draws with
replacement), so the pass runs over a snapshot: every item of the table, read once when the
pass is made (see `Backend.read_items`), then held in this process as numpy arrays. Nothing is
sampled from the live table, so rate limiters and `times_sampled` are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
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


class EpochOptions(NamedTuple):
    """The options of an epoch pass, checked (`check_options` returns them).

    Attributes:
      batch_size: Items per batch.
      num_epochs: Passes over the items.
      seed: Seed of the permutations; None draws fresh ones.
      drop_last: Leave out each epoch's last batch when it is shorter than `batch_size`.
      transitions: Yield `TransitionBatch`es (tables of 2-step, unpadded items).
    """

    batch_size: int
    num_epochs: int
    seed: int | None
    drop_last: bool
    transitions: bool


class EpochBatches:
    """An iterable of shuffled batches that hold every item exactly once per epoch.

    Iterating yields `num_epochs * batches_per_epoch` batches: epoch after epoch, each a new
    permutation of the items cut into batches of `batch_size`. A batch is what `torch_batches`
    yields without `with_info`: the item nest of torch tensors `[batch, sequence_length, ...]`
    (a TF-Agents `Trajectory`, or `Masked(step, mask)` for padded tables), or a
    `TransitionBatch` with `transitions=True`. Each `iter()` starts again from epoch 0: with a
    `seed` it repeats the same batches, without one it draws new permutations.

    Args:
      data: One numpy array per field of the table signature (`tree.flatten` order), each
        `[num_items, sequence_length, ...]` (the export layout).
      structure: The per-step stored spec (what `tree.unflatten_as` packs the fields into).
      options: The pass's sizes and flags, checked (`check_options`).
      device: Torch device the batches are moved to.
      table_name: The table the items come from (for error messages).

    Raises:
      ConfigError: If the device is invalid, `transitions` does not apply to the items, or
        `drop_last` leaves no batch (fewer items than `batch_size`).
      BufferStateError: If there are no items.
    """

    def __init__(
        self,
        data: Sequence[np.ndarray],
        structure: Any,
        options: EpochOptions,
        *,
        device: str | torch.device = "cpu",
        table_name: str = "",
    ) -> None:
        batch_size, transitions = options.batch_size, options.transitions
        self._device = resolve_device(device)  # the streams' check
        self._data = list(data)
        self.num_items = int(self._data[0].shape[0]) if self._data else 0
        if self.num_items == 0:
            raise BufferStateError(f"table {table_name!r} holds no items to pass over")
        sequence_length = int(self._data[0].shape[1])
        if transitions and isinstance(structure, Masked):
            raise ConfigError(
                f"transitions=True does not apply to table {table_name!r}, whose items are "
                "padded Masked(step, mask) sequences; use transitions=False"
            )
        if transitions and sequence_length != TRANSITION_SEQUENCE_LENGTH:
            raise ConfigError(
                f"transitions=True needs sequence_length={TRANSITION_SEQUENCE_LENGTH}, table "
                f"{table_name!r} has sequence_length={sequence_length}; use transitions=False"
            )
        if options.drop_last and self.num_items < batch_size:
            raise ConfigError(
                f"drop_last=True with batch_size={batch_size} leaves no batch: table "
                f"{table_name!r} holds {self.num_items} items"
            )
        self.batch_size = batch_size
        self.num_epochs = options.num_epochs
        self.seed = options.seed
        self.drop_last = options.drop_last
        self._packer: Packer = stream_packer(structure, transitions)

    @property
    def batches_per_epoch(self) -> int:
        """Batches in each epoch."""
        if self.drop_last:
            return self.num_items // self.batch_size
        return math.ceil(self.num_items / self.batch_size)

    def __len__(self) -> int:
        """Batches yielded by one iteration: `num_epochs * batches_per_epoch`."""
        return self.num_epochs * self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        rng = np.random.default_rng(self.seed)
        per_epoch = self.batches_per_epoch
        for _ in range(self.num_epochs):
            order = rng.permutation(self.num_items)
            for index in range(per_epoch):
                rows = order[index * self.batch_size : (index + 1) * self.batch_size]
                yield self._batch(rows)

    def _batch(self, rows: np.ndarray) -> Any:
        flat = [torch.from_numpy(np.ascontiguousarray(a[rows])) for a in self._data]
        if self._device.type != "cpu":
            flat = [t.to(self._device) for t in flat]
        return self._packer(flat)


def check_options(
    batch_size: Any, num_epochs: Any, seed: Any, drop_last: Any, transitions: Any
) -> EpochOptions:
    """Refuses bad `epoch_batches` options before anything is read.

    Returns:
      The options, as given.

    Raises:
      ConfigError: Naming the option and its value.
    """
    require_positive_int("batch_size", batch_size, maximum=None)
    require_positive_int("num_epochs", num_epochs, maximum=None)
    require_seed("seed", seed)
    require_flag("drop_last", drop_last)
    require_flag("transitions", transitions)
    return EpochOptions(batch_size, num_epochs, seed, drop_last, transitions)


def epoch_batches(
    view: SampleView,
    batch_size: int,
    num_epochs: int = 1,
    seed: int | None = None,
    drop_last: bool = False,
    transitions: bool = False,
    device: str | torch.device = "cpu",
    table: str | None = None,
) -> EpochBatches:
    """`EpochBatches` of the items one table of the buffer holds now.

    The items are a snapshot read once (`Backend.read_items`; embedded Reverb: a snapshot
    checkpoint read from `<checkpoint_dir>/.snapshots/` and deleted, never a checkpoint: it
    neither counts towards `keep_checkpoints` nor becomes the newest, checkpoints go on while it
    is read, and one a killed process left is deleted on the next start; remote: a checkpoint
    taken now, which becomes the newest, as with `export()`, and needs the checkpoint files on
    this machine; local: a copy), held in memory and never sampled from the table, so rate
    limiters and `times_sampled` are untouched. The collectors are flushed first.

    Args:
      view: The buffer.
      batch_size: Items per batch.
      num_epochs: Passes over the items.
      seed: Seed of the permutations; None draws fresh ones.
      drop_last: Leave out each epoch's last, shorter batch.
      transitions: Yield `TransitionBatch`es.
      device: Torch device of the batches.
      table: The table read; None: the primary one.

    Returns:
      The batches.

    Raises:
      ConfigError: If an option is invalid (`check_options`; the batch size and device as
        `torch_batches`), checked before the snapshot is read; `table` is unknown (first);
        `transitions` does not apply or `drop_last` leaves no batch.
      BufferStateError: If the buffer was not created or loaded, or the table is empty.
      CheckpointError: Reverb: if the snapshot's checkpoint cannot be taken or read.
    """
    config = view.table(table)
    options = check_options(batch_size, num_epochs, seed, drop_last, transitions)
    # Before the snapshot is read: a batch holds at most the table's items.
    view.check_batches(config, batch_size, device, held=config.capacity)
    view.require_buffer()
    view.writers.flush()
    items = view.backend.read_items(config)
    return EpochBatches(
        items.data, view.stored_spec, options, device=device, table_name=config.name
    )
