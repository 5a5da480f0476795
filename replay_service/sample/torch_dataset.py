"""The torch `Dataset` side of sampling: `TorchReplayDataset`, for `DataLoader` workers

`TorchReplayDataset` (`manager.torch_dataset(...)`) is a `torch.utils.data.IterableDataset` for
`DataLoader(dataset, batch_size=None, num_workers=N)`: each worker samples on its own (a Reverb
connection of its own, or a local table's shared memory) through `torch_streams.iterate_batches`.
`data_loader()` builds a `DataLoader` whose workers start the way the source allows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from replay_service.config.options import require_int
from replay_service.errors import BufferStateError, ConfigError
from replay_service.sample.stream_options import check_sizes
from replay_service.sample.torch_streams import TorchSampleSource, iterate_batches

if TYPE_CHECKING:
    from replay_service.sample.view import SampleView

DEFAULT_MP_CONTEXT = "forkserver"


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
        batch_size = check_sizes(batch_size, transitions, source)
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
