"""Weighted mixes of several tables in PyTorch batches, as `mixed_dataset` mixes them for tf.data.

`config.tables.check_mix_weights` validates the weights of both. tf.data (`mixed_dataset`,
Reverb only) draws every item's table in `tf.data.Dataset.sample_from_datasets`. The PyTorch mix
(`manager.mixed_torch_batches`, every backend) does the same in `MixedSampleSource`: for each
batch, every item's table is drawn independently, table `name` with probability
`weights[name] / sum(weights)`, from a generator seeded by `seed`; the items themselves are
drawn by each table's own sampler (uniform, prioritized...) through that table's ordinary
torch source. A batch thus holds `Binomial(batch_size, p)` items of a table of probability `p`:
the proportions hold on average, not in every batch, as with `mixed_dataset`.

Each table's source is sampled in chunks of about its share of a batch
(`ceil(batch_size * p)` items); items of a chunk not used by one batch are used by the next
ones (like batches sampled ahead, they may miss items inserted since). Items drawn before a
`clear()` are dropped. The items of a batch keep their drawn positions, the tables interleaved;
`MixedSampleInfo.table` says which table each came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from replay_service.config.options import require_seed
from replay_service.config.tables import check_mix_weights
from replay_service.errors import ManagerClosedError
from replay_service.sample import torch_streams
from replay_service.sample.batches import Packer
from replay_service.sample.sources import PackingSource, SampleRequest, TorchSamples
from replay_service.sample.torch_streams import TorchSampleSource

if TYPE_CHECKING:
    from replay_service.sample.view import SampleView


class MixedSampleInfo(NamedTuple):
    """Sample info of a mixed torch batch: each item's own table's info, and that table.

    Attributes:
      key: Item keys (`torch.uint64`); pass them with `table=` to `update_priorities`.
      probability: Probability of the item in its own table (`float64`).
      table_size: Items in its table when sampled (`int64`).
      priority: Priority of the item (`float64`).
      times_sampled: Times the item was sampled, this time included (`int32`).
      table: Position of the item's table in the `weights` mapping, in its iteration order
        (`int64`), e.g. `list(weights)[info.table[i]]` is the name.
    """

    key: torch.Tensor
    probability: torch.Tensor
    table_size: torch.Tensor
    priority: torch.Tensor
    times_sampled: torch.Tensor
    table: torch.Tensor


class _Chunks:
    """The items one table's stream sampled and no batch used yet, oldest first."""

    def __init__(self, stream: Iterator[tuple[list[torch.Tensor], Any]]) -> None:
        self._stream = stream
        self._chunks: list[tuple[list[torch.Tensor], tuple[torch.Tensor, ...] | None]] = []
        self._offset = 0  # rows of the first chunk already used

    def drop(self) -> None:
        """Forgets every item held (they were drawn before the table was cleared)."""
        self._chunks = []
        self._offset = 0

    def take(self, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The next `count` items: flat prepared tensors and info tensors, `[count, ...]`.

        Raises:
          Whatever the table's stream raises (an empty table, a lost server, a closed manager).
        """
        data_parts: list[list[torch.Tensor]] = []
        info_parts: list[tuple[torch.Tensor, ...] | None] = []
        needed = count
        while needed:
            if not self._chunks:
                self._chunks.append(next(self._stream))
                self._offset = 0
            data, info = self._chunks[0]
            rows = data[0].shape[0] - self._offset
            used = min(rows, needed)
            end = self._offset + used
            data_parts.append([t[self._offset : end] for t in data])
            info_parts.append(None if info is None else tuple(t[self._offset : end] for t in info))
            needed -= used
            if used == rows:
                self._chunks.pop(0)
                self._offset = 0
            else:
                self._offset = end
        data = _concat(data_parts)
        if info_parts[0] is None:
            return data, None
        return data, _concat([list(p) for p in info_parts if p is not None])


def _concat(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per tensor, its parts concatenated along the batch."""
    if len(parts) == 1:
        return parts[0]
    return [
        _signed(torch.cat([_signed(t) for t in column]), column[0].dtype)
        for column in zip(*parts, strict=True)
    ]


def _signed(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A uint64 tensor (item keys) as an int64 view, which every torch operation takes; with
    `dtype` uint64, the int64 view turned back."""
    if dtype is torch.uint64:
        return tensor.view(torch.uint64)
    return tensor.view(torch.int64) if tensor.dtype is torch.uint64 else tensor


class MixedSampleSource(PackingSource):
    """Several tables' torch sources as one `TorchSampleSource` (see module docs).

    `torch_batches`-style streams (`TorchBatchStream`) sample it like one table: devices,
    pinning, prefetching, transitions and the bounds on a lost server or a closed manager are
    theirs; with `with_info` the info is a `MixedSampleInfo`.

    Args:
      sources: Table name -> that table's torch source, the tables of positive weight.
      probabilities: Table name -> probability (summing to 1), as
        `config.tables.check_mix_weights` returns.
      positions: Table name -> the position reported in `MixedSampleInfo.table`.
      seed: Seed of the choice of tables; None draws one.

    Raises:
      ConfigError: If `seed` is not None or an integer >= 0, or the sources' items differ.
    """

    info_type = MixedSampleInfo

    def __init__(
        self,
        sources: Mapping[str, TorchSampleSource],
        probabilities: Mapping[str, float],
        positions: Mapping[str, int],
        seed: int | None = None,
    ) -> None:
        require_seed("seed", seed)
        self._names = list(probabilities)
        self._sources = [sources[name] for name in self._names]
        self._probabilities = np.array([probabilities[n] for n in self._names], np.float64)
        self._probabilities /= self._probabilities.sum()
        self._positions = [positions[name] for name in self._names]
        self._seed = seed
        first = self._sources[0]
        self.table_name = "+".join(self._names)
        self.sequence_length = first.sequence_length
        self.signature = first.signature
        # The tables have one spec and sequence length (`check_mix_weights`).
        self.item_bytes = getattr(first, "item_bytes", None)

    def closed_error(self) -> ManagerClosedError | None:
        """The error of the first source whose manager was closed, else None."""
        for source in self._sources:
            closed_error: Callable[[], Any] | None = getattr(source, "closed_error", None)
            error = closed_error() if closed_error is not None else None
            if error is not None:
                return error
        return None

    def _clears(self) -> list[int]:
        return [source.clears() if hasattr(source, "clears") else 0 for source in self._sources]

    def _samples(self, request: SampleRequest) -> TorchSamples:
        """Mixed batches of exactly `batch_size` items, forever (see `PackingSource`):
        `num_workers` is passed to every table's source, `convert` applied to every data
        tensor of the mixed batch; with `with_info` the info is the five `TorchSampleInfo`
        tensors and the item's table (`MixedSampleInfo`'s fields), the `table` tensor last.

        Raises:
          BufferStateError, ServerUnavailableError, ManagerClosedError: As a table's source
            raises them (an empty table, a lost server, a closed manager), naming the table.
        """
        batch_size, convert, pack = request.batch_size, request.convert, request.pack
        with_info = request.with_info
        # The sources prepare their chunks; the mixed batch is built once from their rows.
        rows_of = Packer(pack.prepare, list, pack.prepare_rows)
        chunks = [
            _Chunks(
                source.torch_samples(
                    max(1, math.ceil(batch_size * p)),
                    num_workers=request.num_workers,
                    convert=None,
                    pack=rows_of,
                    with_info=with_info,
                )
            )
            for source, p in zip(self._sources, self._probabilities, strict=True)
        ]
        rng = np.random.default_rng(self._seed)
        positions = np.array(self._positions, np.int64)
        clears = self._clears()
        while True:
            if self._clears() != clears:
                for held in chunks:
                    held.drop()
                clears = self._clears()
            choice = rng.choice(len(chunks), size=batch_size, p=self._probabilities)
            picked = []
            for index, held in enumerate(chunks):
                rows = np.flatnonzero(choice == index)
                if rows.size:
                    picked.append((torch.from_numpy(rows), *held.take(rows.size)))
            data = _interleave(batch_size, [(rows, d) for rows, d, _ in picked])
            if convert is not None:
                data = [convert(t) for t in data]
            info = None
            if with_info:
                info = (
                    *_interleave(batch_size, [(rows, i) for rows, _, i in picked]),
                    torch.from_numpy(positions[choice]),
                )
            yield pack.build(data), info


def _interleave(
    batch_size: int, parts: list[tuple[torch.Tensor, list[torch.Tensor] | None]]
) -> list[torch.Tensor]:
    """One batch's flat tensors from each table's rows, placed at that table's positions."""
    if len(parts) == 1:
        return list(parts[0][1] or [])
    first = parts[0][1] or []
    out = [torch.empty((batch_size, *t.shape[1:]), dtype=_signed(t).dtype) for t in first]
    for rows, tensors in parts:
        for target, tensor in zip(out, tensors or [], strict=True):
            target[rows] = _signed(tensor)
    return [_signed(t, like.dtype) for t, like in zip(out, first, strict=True)]


def mixed_torch_batches(
    view: SampleView,
    batch_size: int,
    weights: Mapping[str, float],
    seed: int | None = None,
    device: str | torch.device = "cpu",
    pin_memory: bool = False,
    prefetch: int | None = None,
    transitions: bool = False,
    with_info: bool = False,
) -> torch_streams.TorchBatchStream:
    """An endless stream of torch batches mixing several tables of the buffer, on every backend.

    Each item of a batch comes from table `name` with probability `weights[name] /
    sum(weights)`, drawn independently per item from a generator seeded by `seed`, and is
    sampled by that table's own sampler. The proportions hold on average (a batch holds a
    binomial number of each table's items), and the tables' items are interleaved in a batch.
    With `with_info`, batches come as `(batch, MixedSampleInfo)`: each item's own table's info,
    and `info.table`, the position of its table in `weights`. Batches and the other options
    are those of `torch_streams.torch_batches`.

    Args:
      view: The buffer.
      batch_size: Items per batch.
      weights: Table name -> weight; finite, >= 0, with a positive sum. The tables must have
        one sequence length.
      seed: Seed of the choice of tables (an integer >= 0); None draws one. The items of each
        table are drawn by its sampler, which no seed fixes.
      device: Where the tensors are placed.
      pin_memory: Pin host memory before the transfer to `device`.
      prefetch: Batches prepared ahead by a background thread; None: none.
      transitions: Yield `TransitionBatch`es (tables of 2-step items).
      with_info: Yield `(batch, MixedSampleInfo)` pairs.

    Returns:
      A `TorchBatchStream` (close it, or use it in `with`, to stop its thread).

    Raises:
      BufferStateError: If the buffer was not created or loaded (first); when iterating, if a
        table yields nothing within `Timeouts.sample` (named).
      ConfigError: If a weight, table name, size, seed or option is invalid, or the tables'
        sequence lengths differ.
    """
    replay_buffer = view.require_buffer()
    probabilities = check_mix_weights(view.tables, weights)
    sources = {
        name: view.backend.torch_source(replay_buffer, view.table(name)) for name in probabilities
    }
    source = MixedSampleSource(
        sources, probabilities, {name: i for i, name in enumerate(weights)}, seed=seed
    )
    return torch_streams.TorchBatchStream(
        source,
        batch_size,
        device=device,
        pin_memory=pin_memory,
        prefetch=torch_streams.DEFAULT_PREFETCH if prefetch is None else prefetch,
        transitions=transitions,
        with_info=with_info,
    )
