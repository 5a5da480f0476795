"""PyTorch sampling from the Reverb table that TF-Agents collectors (or `writers`) fill.

A `reverb.TrajectoryDataset` batched by tf.data and iterated eagerly, each batched field handed
to torch without a copy (DLPack, or `torch.from_numpy` for dtypes DLPack lacks). Nothing loops
over items in Python.

- `TorchBatchStream` (`manager.torch_batches(...)`): an iterator in the training process, with an
  optional background thread (`sample.prefetch`) that samples, converts, pins and moves batches
  to `device` ahead of use into a bounded queue.
- `TorchReplayDataset` (`manager.torch_dataset(...)`, `sample.torch_dataset`): a
  `torch.utils.data.IterableDataset` over the same `iterate_batches`, for DataLoader workers.

Each batch is either the nested `Trajectory` (same nest type as the data spec, every tensor of
shape `[batch_size, sequence_length, ...]`) or, with `transitions=True`, a `TransitionBatch`
(see its docstring for the exact mapping from TF-Agents step types and discounts).

Items are drawn by the server (its sampler and rate limiter), not in the client. With the
uniform or prioritized sampler every draw is random with replacement, so independent streams,
threads or DataLoader workers never repeat one another's sequence, and there is no client-side
seed that could be duplicated; with an ordered sampler (FIFO, LIFO, heaps) they share the order.

The torch side needs no TensorFlow: `iterate_batches`, `TorchBatchStream` and
`TorchReplayDataset` sample any `TorchSampleSource`, an object whose `torch_samples` yields
batches already as torch tensors (`sample.sources.PackingSource` is the base of the project's
own). `SampleSource` is the Reverb one (its tf.data pipeline imports TensorFlow when sampling
starts); the in-process backend has its own.

This module holds the batch stream. What a batch is built into (`TransitionBatch`,
`TorchSampleInfo`, the packers, `draws_per_call`) lives in `replay_service.sample.batches`, the
checks of a stream's options in `replay_service.sample.stream_options`, and the Reverb source
(`SampleSource`, `tensor_to_torch`) in `replay_service.backends.reverb.torch_source`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from replay_service.config.options import require_int
from replay_service.errors import ManagerClosedError
from replay_service.sample.batches import Packer, TorchSampleInfo, stream_packer, to_transitions
from replay_service.sample.prefetch import Prefetcher
from replay_service.sample.stream_options import (
    check_sizes,
    placer,
    resolve_device,
    resolve_pin_memory,
)

if TYPE_CHECKING:
    from replay_service.sample.view import SampleView

# Batches prepared ahead by a Python thread. None by default: the Reverb pipeline prefetches in
# tf.data's C++ threads, which do not hold the GIL, and a local table is sampled in
# microseconds; a Python thread beside a collecting loop made every `add` wait for the GIL.
DEFAULT_PREFETCH = 0


class TorchSampleSource(Protocol):
    """What `iterate_batches`, `TorchBatchStream` and `TorchReplayDataset` sample from.

    Attributes:
      table_name: The table sampled (named in errors and thread names).
      sequence_length: Steps per item.
      signature: Nest of specs of one item (leading dimension `sequence_length`): TF specs or
        `array_specs.ArraySpec`; a `sequences.Masked` nest for padded tables.


    A source may also have `closed_error()`, returning the exception to raise once its manager
    was closed (else None): `TorchBatchStream` then fails at once, before batches sampled ahead;
    `clears()`, counting the times its table was emptied; and `info_type`, the class the info
    tensors are yielded as (default `TorchSampleInfo`).
    A source whose `torch_samples` takes no `pack` (nor `with_info`) yields the item nest and
    its info; `iterate_batches` then turns the nest into transitions itself.
    """

    @property
    def table_name(self) -> str: ...

    @property
    def sequence_length(self) -> int: ...

    @property
    def signature(self) -> Any: ...

    def torch_samples(
        self,
        batch_size: int,
        *,
        num_workers: int | None,
        convert: Callable[[torch.Tensor], torch.Tensor] | None,
        pack: Packer | None = None,
        with_info: bool = True,
    ) -> Iterator[tuple[Any, tuple[torch.Tensor, ...] | None]]:
        """Samples batches of exactly `batch_size` items, forever.

        Args:
          batch_size: Items per batch.
          num_workers: Sampling workers behind the iterator; None lets the source choose.
          convert: Applied to every data tensor (pinning, device transfer); None: none.
          pack: Turns the flat data tensors (in `tree.flatten(signature)` order) into what
            is yielded; None: the item nest (`item_packer(signature)`).
          with_info: Whether to yield the sample info (else None: a source may skip it).

        Yields:
          `(data, info)`: `data` the packed item (by default the nest, same nest type as the
          data spec, of torch tensors shaped `[batch_size, sequence_length, ...]`), `info` the
          five CPU tensors of `TorchSampleInfo` (key, probability, table_size, priority,
          times_sampled), each `[batch_size]`, or None without `with_info`.

        Raises:
          BufferStateError: If nothing could be sampled within the source's sample timeout.
          ServerUnavailableError: If the server holding the table is unreachable or lost.
          ManagerClosedError: If the manager that owns the table was closed.
        """
        ...


def iterate_batches(
    source: TorchSampleSource,
    batch_size: int,
    *,
    transitions: bool = False,
    with_info: bool = False,
    place: Callable[[torch.Tensor], torch.Tensor] | None = None,
    num_workers: int | None = None,
) -> Iterator[Any]:
    """Samples batches forever and yields them as torch objects.

    Args:
      source: The table to sample (any `TorchSampleSource`, e.g. a Reverb `SampleSource`).
      batch_size: Items per batch.
      transitions: Yield `TransitionBatch` instead of the nested `Trajectory`.
      with_info: Yield `(data, TorchSampleInfo)` pairs.
      place: Applied to every tensor before anything else (pinning, device transfer).
      num_workers: Sampling workers; None lets the source choose (see
        `SampleSource.tf_dataset`).

    Yields:
      Batches as described by `transitions` and `with_info`.

    Raises:
      BufferStateError: If no item could be sampled within the source's sample timeout.
      ServerUnavailableError: If the server cannot be reached, or was lost while sampling
        (within `liveness.liveness_bound(sample_timeout, connect_timeout)` seconds).
      ManagerClosedError: If the manager was closed (`source.lifeline`).
    """
    if _takes_pack(source):
        pack = stream_packer(source.signature, transitions)
        samples = source.torch_samples(
            batch_size, num_workers=num_workers, convert=place, pack=pack, with_info=with_info
        )
    else:  # a source without `pack`: it yields the item nest
        samples = source.torch_samples(batch_size, num_workers=num_workers, convert=place)
        if transitions:
            samples = ((to_transitions(data), info) for data, info in samples)
    if not with_info:
        for data, _ in samples:
            yield data
        return
    info_type = getattr(source, "info_type", TorchSampleInfo)
    for data, info in samples:
        assert info is not None
        yield data, info_type(*(info if place is None else (place(t) for t in info)))


def _takes_pack(source: TorchSampleSource) -> bool:
    """Whether `source.torch_samples` takes `pack` and `with_info` (sources written before
    they were added to `TorchSampleSource` take neither)."""
    try:
        parameters = inspect.signature(source.torch_samples).parameters
    except (TypeError, ValueError):
        return False
    return {"pack", "with_info"} <= parameters.keys()


class TorchBatchStream:
    """An endless iterator of torch batches from a replay table, optionally prefetched.

    With `prefetch > 0`, one daemon thread samples, converts, pins and moves up to `prefetch`
    batches ahead into a bounded queue; `close()` (also on `with` exit and garbage collection)
    stops it. With `prefetch == 0` (the default) everything happens inside `next()`; the
    Reverb pipeline still samples ahead in tf.data's C++ threads, without the GIL. A thread
    helps only when placing batches on `device` takes long; beside a collecting loop in the
    same process it slows collection, which then waits for the GIL.

    Once the source's manager is closed, `next()` raises `ManagerClosedError` at once, also
    when batches were already sampled ahead.

    Args:
      source: The table to sample (a `TorchSampleSource`, e.g.
        `SampleSource.from_handle(manager.table_handle())`).
      batch_size: Items per batch.
      device: Where the tensors are placed ("cpu", "cuda", "cuda:1", a `torch.device`).
      pin_memory: Pin host memory before the transfer to `device`, making it asynchronous;
        ignored with a warning when no accelerator is available (as `DataLoader` does).
      prefetch: Batches prepared ahead by a background thread; 0 (default): no thread.
      transitions: Yield `TransitionBatch` (needs `sequence_length == 2`) instead of the
        nested `Trajectory`.
      with_info: Yield `(batch, TorchSampleInfo)` pairs.

    Raises:
      ConfigError: If a size is invalid, `device` is unknown or unavailable, or `transitions`
        is asked of windows that are not 2 steps long.
    """

    def __init__(
        self,
        source: TorchSampleSource,
        batch_size: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        prefetch: int = DEFAULT_PREFETCH,
        transitions: bool = False,
        with_info: bool = False,
    ) -> None:
        batch_size = check_sizes(batch_size, transitions, source)
        require_int("prefetch", prefetch, 0, maximum=None)
        target = resolve_device(device)
        place = placer(target, resolve_pin_memory(pin_memory))
        self._source = source
        self._closed_error = getattr(source, "closed_error", None)
        self._produce = lambda: iterate_batches(
            source, batch_size, transitions=transitions, with_info=with_info, place=place
        )
        self._prefetch = prefetch
        self._prefetcher: Prefetcher | None = None
        self._inline: Iterator[Any] | None = None
        self._failure: Exception | None = None
        self._closed = False

    def __iter__(self) -> TorchBatchStream:
        return self

    def __next__(self) -> Any:
        """Returns the next batch.

        Raises:
          BufferStateError: If no item could be sampled within the sample timeout.
          ManagerClosedError: If the stream was closed.
        """
        if self._closed:
            raise ManagerClosedError("this batch stream is closed; ask the manager for a new one")
        failure = self._closed_error() if self._closed_error is not None else None
        if failure is not None:
            raise failure
        if self._prefetch == 0:
            if self._failure is not None:
                raise self._failure
            if self._inline is None:
                self._inline = self._produce()
            try:
                return next(self._inline)
            except Exception as e:  # the generator is finished: keep reporting why
                self._failure = e
                raise
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(
                self._produce, self._prefetch, f"replay_service:torch:{self._source.table_name}"
            )
        return self._prefetcher.get()

    def close(self) -> None:
        """Stops the background thread and releases the sampler. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._prefetcher = self._inline = None

    def __enter__(self) -> TorchBatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()


def torch_batches(
    view: SampleView,
    batch_size: int,
    device: str | torch.device = "cpu",
    pin_memory: bool = False,
    prefetch: int | None = None,
    transitions: bool = False,
    with_info: bool = False,
    table: str | None = None,
) -> TorchBatchStream:
    """An endless `TorchBatchStream` of batches sampled from one table of the buffer.

    Bounded when the server is lost: if it dies (SIGKILL, SIGTERM) or the network drops,
    `next()` raises `ServerUnavailableError` naming the address, the table and what to do
    within `liveness.liveness_bound(timeouts.sample, timeouts.connect)` seconds (at most
    `2 * timeouts.sample + timeouts.connect`); after the manager's `close()` it raises
    `ManagerClosedError` at once.

    Args:
      view: The buffer.
      batch_size: Items per batch.
      device: Where the tensors are placed.
      pin_memory: Pin host memory before the transfer to `device`.
      prefetch: Batches prepared ahead by a background thread; None: `DEFAULT_PREFETCH`.
      transitions: Yield `TransitionBatch`es (tables of 2-step items).
      with_info: Yield `(batch, TorchSampleInfo)` pairs.
      table: The table sampled; None: the primary one.

    Returns:
      The stream (close it, or use it in `with`, to stop its thread).

    Raises:
      BufferStateError: If the buffer was not created or loaded; when iterating, if nothing
        can be sampled within `Timeouts.sample`.
      ConfigError: If an option is invalid (`TorchBatchStream`) or `table` is unknown.
    """
    return TorchBatchStream(
        view.source(table),
        batch_size,
        device=device,
        pin_memory=pin_memory,
        prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch,
        transitions=transitions,
        with_info=with_info,
    )
