"""PyTorch sampling from the Reverb table that TF-Agents collectors (or `writers`) fill.

Two forms share one pipeline: a `reverb.TrajectoryDataset` batched by tf.data and iterated
eagerly, each batched field handed to torch without a copy (DLPack, or `torch.from_numpy` for
dtypes DLPack lacks). Nothing loops over items in Python.

- `TorchBatchStream` (`manager.torch_batches(...)`): an iterator in the training process, with an
  optional background thread that samples, converts, pins and moves batches to `device` ahead of
  use into a bounded queue.
- `TorchReplayDataset` (`manager.torch_dataset(...)`): a `torch.utils.data.IterableDataset` for
  `DataLoader(dataset, batch_size=None, num_workers=N)`; each worker opens its own connection.

Each batch is either the nested `Trajectory` (same nest type as the data spec, every tensor of
shape `[batch_size, sequence_length, ...]`) or, with `transitions=True`, a `TransitionBatch`
(see its docstring for the exact mapping from TF-Agents step types and discounts).

Items are drawn by the server (its sampler and rate limiter), not in the client. With the
uniform or prioritized sampler every draw is random with replacement, so independent streams,
threads or DataLoader workers never repeat one another's sequence, and there is no client-side
seed that could be duplicated; with an ordered sampler (FIFO, LIFO, heaps) they share the order.

The torch side needs no TensorFlow: `iterate_batches`, `TorchBatchStream` and
`TorchReplayDataset` sample any `TorchSampleSource`, an object whose `torch_samples` yields
batches already as torch tensors. `SampleSource` is the Reverb one (its tf.data pipeline imports
TensorFlow when sampling starts); the in-process backend has its own.

This module holds the streams. What a batch is built into (`TransitionBatch`, `TorchSampleInfo`,
the packers, `draws_per_call`) lives in `replay_service.sample.batches`, and the Reverb source
(`SampleSource`, `tensor_to_torch`) in `replay_service.backends.reverb.torch_source`; this module
re-exports the public names it had.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from replay_service.config.batch_limits import require_batch_size
from replay_service.config.devices import require_device
from replay_service.config.options import require_int
from replay_service.errors import BufferStateError, ConfigError, ManagerClosedError
from replay_service.sample.batches import (
    TRANSITION_SEQUENCE_LENGTH,
    Packer,
    TorchSampleInfo,
    item_packer,
    to_transitions,
    transition_packer,
)
from replay_service.specs.windows import Masked

if TYPE_CHECKING:
    from replay_service.sample.view import SampleView

# Batches prepared ahead by a Python thread. None by default: the Reverb pipeline prefetches in
# tf.data's C++ threads, which do not hold the GIL, and a local table is sampled in
# microseconds; a Python thread beside a collecting loop made every `add` wait for the GIL.
DEFAULT_PREFETCH = 0
# How often a blocked producer or consumer looks at the stop flag.
POLL_S = 0.1
# How long close() waits for the background thread before leaving it to finish on its own.
JOIN_TIMEOUT_S = 5.0
DEFAULT_MP_CONTEXT = "forkserver"

_ITEM, _END, _ERROR = "item", "end", "error"


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
        pack = transition_packer(source.signature) if transitions else item_packer(source.signature)
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
        batch_size = _check_sizes(batch_size, transitions, source)
        require_int("prefetch", prefetch, 0, maximum=None)
        target = _resolve_device(device)
        place = _placer(target, _resolve_pin_memory(pin_memory))
        self._source = source
        self._closed_error = getattr(source, "closed_error", None)
        self._produce = lambda: iterate_batches(
            source, batch_size, transitions=transitions, with_info=with_info, place=place
        )
        self._prefetch = prefetch
        self._prefetcher: _Prefetcher | None = None
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
            self._prefetcher = _Prefetcher(
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


class TorchReplayDataset(IterableDataset):
    """An endless `IterableDataset` of torch batches for `DataLoader(..., batch_size=None)`.

    The dataset holds only a picklable `SampleSource`; every process that iterates it opens its
    own Reverb connection on its first batch. Batches stay on the CPU (use the DataLoader's
    `pin_memory=True` and move them in the training loop).

    DataLoader workers must be started with "forkserver" or "spawn": gRPC and TensorFlow cannot
    run in a process forked from one that already uses them (the process hangs). `data_loader()`
    sets this; with another DataLoader, pass `multiprocessing_context="forkserver"`. A worker
    started by plain fork raises `BufferStateError` saying so instead of hanging. Workers sample
    independently: the server draws every item at random, so workers never yield copies of one
    another's stream, and their seeds (which torch makes distinct per worker) are not involved.

    A local table (backend="local") is sampled by workers from shared memory, read-only, each
    worker with its own generator (seeded from the manager's `seed=` and the worker id); any
    start method works, fork included (see `backends.local.shared`).

    Args:
      source: The table to sample (a `TorchSampleSource`, e.g.
        `SampleSource.from_handle(manager.table_handle())`).
      batch_size: Items per batch (the DataLoader must not batch again: `batch_size=None`).
      transitions: Yield `TransitionBatch` instead of the nested `Trajectory`.
      with_info: Yield `(batch, TorchSampleInfo)` pairs.

    Raises:
      ConfigError: If `batch_size` is invalid or `transitions` is asked of windows that are not
        2 steps long.
    """

    def __init__(
        self,
        source: TorchSampleSource,
        batch_size: int,
        *,
        transitions: bool = False,
        with_info: bool = False,
    ) -> None:
        super().__init__()
        batch_size = _check_sizes(batch_size, transitions, source)
        self.source = source
        self.batch_size = batch_size
        self.transitions = transitions
        self.with_info = with_info
        self._owner_pid = os.getpid()
        self._unpickled = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unpickled = True

    def __iter__(self) -> Iterator[Any]:
        """Samples batches forever in the calling process or DataLoader worker.

        Raises:
          BufferStateError: If no item could be sampled within the sample timeout, or if this
            is a DataLoader worker started by fork.
        """
        worker = get_worker_info()
        forked = not self._unpickled and os.getpid() != self._owner_pid
        if worker is not None and forked and not getattr(self.source, "fork_safe", False):
            raise BufferStateError(
                f"DataLoader worker {worker.id} was started by fork, where gRPC and TensorFlow "
                "hang; create the DataLoader with multiprocessing_context='forkserver' (or "
                "'spawn'), or use TorchReplayDataset.data_loader()"
            )
        return iterate_batches(
            self.source,
            self.batch_size,
            transitions=self.transitions,
            with_info=self.with_info,
            num_workers=1 if worker is not None else None,
        )

    def data_loader(
        self,
        num_workers: int = 2,
        *,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        **kwargs: Any,
    ) -> DataLoader:
        """Returns a `DataLoader` over this dataset with workers that can use its source.

        Reverb: each worker samples on its own connection, started with "forkserver" by
        default. Local backend: the table moves into shared memory first
        (`LocalSampleSource.prepare_workers`) and every worker samples it read-only with a
        generator of its own; workers start with the platform's default method (fork on
        Linux), any method works.

        Args:
          num_workers: Worker processes (0: in-process).
          pin_memory: Let the DataLoader pin batches (needs an accelerator).
          multiprocessing_context: "fork", "forkserver" or "spawn"; None: "forkserver" for
            Reverb, the platform's default for a local table. "fork" is refused for Reverb
            (it hangs, see class docs).
          **kwargs: Other `DataLoader` arguments (`prefetch_factor`, `persistent_workers`...).

        Raises:
          ConfigError: If `multiprocessing_context` is unknown, or "fork" with Reverb,
            `num_workers` < 0, or a local table's sampling cannot run in workers (a sampler
            other than "uniform", `max_times_sampled`).
        """
        require_int("num_workers", num_workers, 0)
        fork_safe = bool(getattr(self.source, "fork_safe", False))
        allowed = ("fork", "forkserver", "spawn") if fork_safe else ("forkserver", "spawn")
        if multiprocessing_context is None:
            multiprocessing_context = None if fork_safe else DEFAULT_MP_CONTEXT
        elif multiprocessing_context not in allowed:
            raise ConfigError(
                f"multiprocessing_context must be one of {allowed}"
                + ("" if fork_safe else " (gRPC and TensorFlow hang in forked workers)")
                + f", got {multiprocessing_context!r}"
            )
        if num_workers == 0:
            return DataLoader(self, batch_size=None, pin_memory=pin_memory, **kwargs)
        prepare = getattr(self.source, "prepare_workers", None)
        if prepare is not None:
            prepare()
        return DataLoader(
            self,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            multiprocessing_context=multiprocessing_context,
            **kwargs,
        )


class _Prefetcher:
    """Runs an iterator in a daemon thread, `depth` items ahead, through a bounded queue."""

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int, name: str) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._final: tuple[str, Any] | None = None
        self._thread = threading.Thread(
            target=_fill, args=(produce, self._queue, self._stop), name=name, daemon=True
        )
        self._thread.start()

    def get(self) -> Any:
        """Returns the next item; re-raises the producer's error; StopIteration at its end."""
        entry = self._final
        while entry is None:
            try:
                entry = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    entry = (_END, None)
        kind, value = entry
        if kind == _ITEM:
            return value
        self._final = entry
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Asks the thread to stop, frees the queue and waits up to `JOIN_TIMEOUT_S`.

        A thread blocked inside a sample call (at most the sample timeout) finishes on its own.
        """
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)


def _fill(
    produce: Callable[[], Iterator[Any]],
    out: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
) -> None:
    try:
        for item in produce():
            if not _put(out, (_ITEM, item), stop):
                return
        _put(out, (_END, None), stop)
    except Exception as e:  # handed to the consumer, which re-raises it
        _put(out, (_ERROR, e), stop)


def _put(out: queue.Queue[tuple[str, Any]], entry: tuple[str, Any], stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(entry, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _check_sizes(batch_size: int, transitions: bool, source: TorchSampleSource) -> int:
    """Checks a stream's batch size and `transitions` against its source; returns the batch
    size as an `int`."""
    batch_size = require_batch_size(
        "batch_size", batch_size, _item_bytes(source), what=f"table {source.table_name!r}"
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


def _item_bytes(source: TorchSampleSource) -> int:
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


def _resolve_device(device: str | torch.device) -> torch.device:
    """The device batches are placed on (`require_device`: refused at the call if it holds no
    data or is not on this machine, never at the first batch)."""
    return require_device(device)


def _resolve_pin_memory(pin_memory: bool) -> bool:
    if pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "pin_memory=True but no accelerator is available; batches are not pinned",
            stacklevel=3,
        )
        return False
    return bool(pin_memory)


def _placer(device: torch.device, pin: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if device.type == "cpu" and not pin:
        return None

    def place(tensor: torch.Tensor) -> torch.Tensor:
        if pin:
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=pin)

    return place


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


def torch_dataset(
    view: SampleView,
    batch_size: int,
    transitions: bool = False,
    with_info: bool = False,
    table: str | None = None,
) -> TorchReplayDataset:
    """A `TorchReplayDataset` of batches sampled from one table of the buffer.

    Iterating fails like `torch_batches` when the server is lost; a DataLoader worker holds a
    copy of the manager's state, so after `close()` it fails when the (embedded) server is gone.

    Args:
      view: The buffer.
      batch_size: Items per batch.
      transitions: Yield `TransitionBatch`es.
      with_info: Yield `(batch, TorchSampleInfo)` pairs.
      table: The table sampled; None: the primary one.

    Returns:
      The dataset (`dataset.data_loader(num_workers=N)` reads it in worker processes).

    Raises:
      BufferStateError: If the buffer was not created or loaded.
      ConfigError: If an option is invalid (`TorchReplayDataset`) or `table` is unknown.
    """
    return TorchReplayDataset(
        view.source(table), batch_size, transitions=transitions, with_info=with_info
    )
