"""What the torch sample sources share: the one `torch_samples` call, and handing out draws

Every backend's source of torch batches (the local table's, its DataLoader workers', the Reverb
table's, a weighted mix of tables) is a `PackingSource`: it takes the `torch_samples` call of
`torch_streams.TorchSampleSource` as one `SampleRequest` (the default packer filled in) and
yields its batches from `_samples`. A source that draws several batches per call hands them
out one by one through `hand_out`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from replay_service.errors import ManagerClosedError
from replay_service.sample.batches import Packer, item_packer

TorchSamples = Iterator[tuple[Any, tuple[torch.Tensor, ...] | None]]
"""What `torch_samples` yields: `(data, info)` pairs, `info` None without `with_info`."""


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """The arguments of one `torch_samples` call.

    Attributes:
      batch_size: Items per batch.
      num_workers: Sampling workers behind the iterator; None lets the source choose.
      convert: Applied to every data tensor (pinning, device transfer); None: none.
      pack: Turns the flat data tensors into what is yielded (the item nest by default).
      with_info: Whether to yield the sample info (else None).
    """

    batch_size: int
    num_workers: int | None
    convert: Callable[[torch.Tensor], torch.Tensor] | None
    pack: Packer
    with_info: bool


class PackingSource:
    """The base of the torch sample sources: `torch_samples` as `TorchSampleSource` has it.

    A subclass has a `signature` (the item nest, whose `item_packer` is the default `pack`) and
    yields its batches from `_samples(request)`.
    """

    signature: Any

    def torch_samples(
        self,
        batch_size: int,
        *,
        num_workers: int | None = None,
        convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pack: Packer | None = None,
        with_info: bool = True,
    ) -> TorchSamples:
        """Samples batches of exactly `batch_size` items, forever (see the source's `_samples`).

        Args:
          batch_size: Items per batch.
          num_workers: Sampling workers behind the iterator; None lets the source choose.
          convert: Applied to every data tensor (pinning, device transfer); the info tensors
            stay on the CPU.
          pack: Flat data tensors (in `tree.flatten(signature)` order) -> what is yielded;
            None: the item nest (`item_packer(signature)`).
          with_info: Whether to yield the info tensors (else None).

        Yields:
          `(data, info)` pairs of torch tensors, as `TorchSampleSource.torch_samples` says.

        Raises:
          BufferStateError: If nothing could be sampled within the source's sample timeout.
          ServerUnavailableError: If the server holding the table is unreachable or lost.
          ManagerClosedError: If the manager that owns the table was closed.
        """
        if pack is None:
            pack = item_packer(self.signature)
        yield from self._samples(SampleRequest(batch_size, num_workers, convert, pack, with_info))

    def _samples(self, request: SampleRequest) -> TorchSamples:
        """The batches of `torch_samples`, its arguments as `request`."""
        raise NotImplementedError


class DrawingSource(Protocol):
    """A source whose draws `hand_out` hands out: it tells a closed manager and a clear."""

    def closed_error(self) -> ManagerClosedError | None: ...

    def clears(self) -> int: ...


def hand_out(
    source: DrawingSource,
    pack: Packer,
    parts: Sequence[Sequence[torch.Tensor]],
    info_parts: Sequence[Sequence[torch.Tensor]] | None,
    draws: int,
    clears: int,
) -> TorchSamples:
    """Yields the `draws` batches drawn by one call, one by one.

    Before every batch but the first it raises the source's `closed_error()` once its manager
    was closed, and stops once the table was cleared (the rest were drawn before the clear).

    Args:
      source: The source drawn from.
      pack: Builds each batch from its slices (`Packer.build`).
      parts: Per prepared data tensor, its `draws` batches (`batches.split_batches`).
      info_parts: Per info tensor, its `draws` batches; None: no info.
      draws: Batches drawn.
      clears: `source.clears()` when they were drawn.

    Yields:
      `(data, info)` pairs, `info` None when `info_parts` is.

    Raises:
      ManagerClosedError: If the manager was closed while batches were still held.
    """
    build = pack.build
    # Per batch, its slice of every tensor (one pass, not a list per batch).
    batches = list(zip(*parts, strict=False))
    infos = None if info_parts is None else list(zip(*info_parts, strict=False))
    for k in range(draws):
        if k:
            closed = source.closed_error()
            if closed is not None:
                raise closed
            if source.clears() != clears:
                break
        yield build(batches[k]), None if infos is None else infos[k]
