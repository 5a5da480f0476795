"""Sampling streams of the local backend: torch batches, tf.data datasets, a replay buffer.

Every stream samples a `LocalTable` in the calling thread (no server, no prefetch needed) and
gives what the Reverb streams give: torch batches through `torch_sampling` (the source below
has the `torch_samples` call it needs), and tf.data batches of `(trajectory, SampleInfo)` with
leading dimensions `[batch, sequence_length]`, the info broadcast along the sequence, as
`get_dataset` and TF-Agents' `as_dataset` do.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import tree
from torch.utils.data import get_worker_info

from replay_service.backends.base import Lifeline
from replay_service.backends.local.shared import SharedTable
from replay_service.backends.local.table import LocalTable
from replay_service.config.batch_limits import require_batch_size
from replay_service.errors import ConfigError, ManagerClosedError
from replay_service.sample.sources import PackingSource, SampleRequest, TorchSamples, hand_out

# A torch stream of a uniform local table draws up to this many items and batches per table
# call (within `batches.DRAW_BYTES`), then hands them out batch by batch: the table's lock,
# selection and draw counts, and the transition flags, are paid once for several batches (a
# batch of 256 CartPole transitions: about 45 us drawn alone, 20 drawn by 16). The batches cap
# how stale a batch may be: items inserted since a draw appear from the next draw, at most
# `DRAW_BATCHES - 1` batches later (a Reverb stream's prefetched samples are stale likewise).
DRAW_ITEMS = 4096
DRAW_BATCHES = 16

# Reverb's `SampleInfo` fields, in its order.
SampleInfo = collections.namedtuple(
    "SampleInfo", ["key", "probability", "table_size", "priority", "times_sampled"]
)
_INFO_DTYPES = ("uint64", "float64", "int64", "float64", "int32")


class LocalSampleSource(PackingSource):
    """One local table as a source of torch batches (see `torch_sampling.iterate_batches`).

    In DataLoader worker processes (`prepare_workers()` first, which `data_loader()` calls)
    it samples the table's `SharedTable` read-only through a `WorkerSampleSource`: forked
    workers find this object and use its shared table, spawned ones receive that source.

    Args:
      table: The table.
      stored_spec: Per-step stored spec (its structure shapes every batch).
      sample_timeout: Seconds to wait for `min_size_to_sample` items; None: forever.
      lifeline: Closed by the manager's `close()`.
    """

    server_address = "local"
    # DataLoader workers may be forked: they use no thread, lock or connection of this process.
    fork_safe = True

    def __init__(
        self,
        table: LocalTable,
        stored_spec: Any,
        sample_timeout: float | None,
        lifeline: Lifeline | None = None,
    ) -> None:
        self.table = table
        self.table_name = table.name
        self.sequence_length = table.config.sequence_length
        self.sample_timeout = sample_timeout
        self.ordered = table.config.sampling.sampler == "fifo"
        self.lifeline = lifeline
        # The per-step stored spec (`Masked` for padded tables), read by `torch_sampling`.
        self.signature = stored_spec
        self._structure = stored_spec
        self._shared: SharedTable | None = None

    @property
    def item_bytes(self) -> int:
        """Bytes of one item as a batch holds it (every field, every step)."""
        return self.table.item_bytes

    def prepare_workers(self) -> None:
        """Moves the table into shared memory (`LocalTable.share_memory`) for DataLoader
        worker processes.

        Raises:
          ConfigError: If the table's sampling cannot run in workers (see there).
          ManagerClosedError: If the manager was closed.
        """
        closed = self.closed_error()
        if closed is not None:
            raise closed
        self._shared = self.table.share_memory()

    def worker_source(self) -> WorkerSampleSource:
        """What a worker process samples: the shared table, read-only.

        Raises:
          ConfigError: If `prepare_workers()` was not called (a DataLoader built by hand).
        """
        if self._shared is None:
            raise ConfigError(
                f"table {self.table_name!r} lives in this process (backend='local'): DataLoader "
                "worker processes sample it once it is in shared memory; build the loader with "
                "manager.torch_dataset(...).data_loader(num_workers=N) (or call "
                "dataset.source.prepare_workers() before DataLoader(dataset, batch_size=None, "
                "num_workers=N)), or use num_workers=0"
            )
        return WorkerSampleSource(self._shared, self._structure, self.sample_timeout)

    def __reduce__(self) -> Any:
        # Sent to a spawned worker: the worker's source, which holds only shared memory.
        return self.worker_source().__reduce__()

    def sample(
        self,
        batch_size: int,
        *,
        with_info: bool = True,
        steps: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """One batch: flat field tensors `[batch, sequence_length, ...]` (with `steps`, one
        `[batch, ...]` tensor per `(field, step)` pair: `LocalTable.sample`) and numpy info (an
        empty dict without `with_info`).

        Raises:
          ConfigError: If `batch_size` is above its ceiling
            (`config.batch_limits.require_batch_size`).
          ManagerClosedError: If the manager was closed.
          BufferStateError: If nothing can be sampled within `sample_timeout`.
        """
        closed = self.closed_error()
        if closed is not None:
            raise closed
        require_batch_size(
            "batch_size", batch_size, self.table.item_bytes, what=f"table {self.table_name!r}"
        )
        return self.table.sample(batch_size, self.sample_timeout, with_info=with_info, steps=steps)

    def clears(self) -> int:
        """How many times the table was emptied (a stream holding items drawn before a change
        drops them)."""
        return self.table.resets

    def closed_error(self) -> ManagerClosedError | None:
        """The error every stream of this source raises once its manager was closed, else None."""
        if self.lifeline is None or not self.lifeline.closed:
            return None
        return ManagerClosedError(
            f"the buffer of table {self.table_name!r} was closed; create or load a new one"
        )

    def _samples(self, request: SampleRequest) -> TorchSamples:
        """The batches of `torch_samples` (see `PackingSource`), in the calling thread
        (`num_workers` is ignored); in a forked DataLoader worker, those of the shared table
        (`worker_source`).

        A uniform table without `max_times_sampled` is drawn `draws_per_call(batch_size)`
        batches at a time (independent draws with replacement, as one batch at a time): a
        batch handed out later may miss items inserted since its draw, as a prefetched Reverb
        stream's may; its info tells the table size and times sampled at the draw (all the
        drawn batches counted). Batches drawn ahead are dropped when the table is cleared.
        Other samplers draw each batch when it is asked for, so priority updates and removals
        apply to the next batch.

        Raises:
          ManagerClosedError, BufferStateError: As `sample`.
        """
        from replay_service.sample.batches import TRANSITION_SEQUENCE_LENGTH, split_batches

        if get_worker_info() is not None:  # a forked worker: the shared table, read-only
            yield from self.worker_source()._samples(request)
            return
        batch_size, convert, pack = request.batch_size, request.convert, request.pack
        # Transitions read only the steps they keep (`Packer.steps`).
        steps = pack.steps if self.sequence_length == TRANSITION_SEQUENCE_LENGTH else None
        if steps is not None and pack.prepare_steps is not None and self.table.pair_steps(steps):
            yield from self._pair_samples(request, steps)
            return
        draws = self.draws_per_call(batch_size)
        prepare = pack.prepare if steps is None else pack.prepare_steps
        assert prepare is not None
        table, timeout, with_info = self.table, self.sample_timeout, request.with_info
        total = batch_size * draws
        checked = False
        while True:
            clears = self.clears()
            if not checked:  # `sample`, the batch size checked the first time only
                data, info = self.sample(total, with_info=with_info, steps=steps)
                checked = True
            else:
                closed = self.closed_error()
                if closed is not None:
                    raise closed
                data, info = table.sample(total, timeout, with_info=with_info, steps=steps)
            if convert is not None:
                data = [convert(t) for t in data]
            infos = (
                tuple(_info_tensor(info[name]) for name in SampleInfo._fields)
                if with_info
                else None
            )
            # Prepared once for all the drawn batches, built per batch from views.
            parts = split_batches(prepare(data), batch_size, draws)
            info_parts = None if infos is None else split_batches(infos, batch_size, draws)
            yield from hand_out(self, pack, parts, info_parts, draws, clears)

    def _pair_samples(
        self, request: SampleRequest, steps: Sequence[tuple[int, int]]
    ) -> TorchSamples:
        """`_samples` of transitions whose stacked observations are drawn ahead
        (`LocalTable.pair_steps`): `DRAW_BATCHES` batches of indices at a time (within
        `DRAW_ITEMS` items, and `batches.DRAW_BYTES` of the fields read with them), their
        frames gathered a batch at a time, as it is handed out. Each batch's draws are counted
        then, and its info (its probability and table size those of the draw); a batch one of
        whose items left the table since the draw (evicted, cleared) is drawn again, with the
        batches after it, fewer at a time while draws go stale."""
        from replay_service.sample.batches import (
            TRANSITION_SEQUENCE_LENGTH,
            draws_per_call,
            split_batches,
        )

        batch_size, convert, pack = request.batch_size, request.convert, request.pack
        prepare, build = pack.prepare_steps, pack.build
        assert prepare is not None
        table, timeout, with_info = self.table, self.sample_timeout, request.with_info
        assert table.frames is not None
        field = table.frames.field
        stacked = table.fields[field]
        stack_bytes = math.prod(stacked["shape"]) * np.dtype(stacked["dtype"]).itemsize
        # What is read at the draw: every field but the stacked observation.
        plain_bytes = table.item_bytes - stack_bytes * TRANSITION_SEQUENCE_LENGTH
        draws = min(DRAW_BATCHES, draws_per_call(batch_size, max(1, plain_bytes), DRAW_ITEMS))
        # Where the stacks go among the prepared tensors (the pairs kept come first, in order).
        at_state, at_next = (steps.index((field, 0)), steps.index((field, 1)))
        # What stands for the stacks until each batch's are gathered.
        placeholder = torch.empty((0,))
        from_numpy = torch.from_numpy
        # Batches drawn per call: halved while draws go stale before they are read (a small
        # table that fast writers turn over), doubled back to `draws` as they are read whole.
        ahead = draws
        checked = False
        while True:
            closed = self.closed_error()
            if closed is not None:
                raise closed
            if not checked:  # the batch size checked the first time only
                require_batch_size(
                    "batch_size", batch_size, table.item_bytes, what=f"table {self.table_name!r}"
                )
                checked = True
            drawn = table.draw_pairs(batch_size, ahead, steps, timeout)
            data = iter(drawn.data if convert is None else [convert(t) for t in drawn.data])
            read = [placeholder if pair[0] == field else next(data) for pair in steps]
            prepared = prepare(read)
            if convert is None:
                # Host tensors: each batch's slices made as numpy views when it is handed out.
                arrays = [
                    None if i in (at_state, at_next) else t.numpy() for i, t in enumerate(prepared)
                ]
                parts = None
            else:
                # Per batch, its slice of every prepared tensor (views); None for the stacks.
                plain = iter(
                    split_batches(
                        [t for i, t in enumerate(prepared) if i not in (at_state, at_next)],
                        batch_size,
                        ahead,
                    )
                )
                none = (None,) * ahead
                parts = list(
                    zip(
                        *(
                            none if i in (at_state, at_next) else next(plain)
                            for i in range(len(prepared))
                        ),
                        strict=True,
                    )
                )
            whole = True
            for k in range(ahead):
                if k:
                    closed = self.closed_error()
                    if closed is not None:
                        raise closed
                got = table.read_pairs(drawn, k, with_info)
                if got is None:  # an item left the table: draw again, fewer ahead
                    ahead, whole = max(1, ahead // 2), False
                    break
                (state, next_state), info = got
                if convert is not None:
                    state, next_state = convert(state), convert(next_state)
                if parts is None:
                    lo = k * batch_size
                    hi = lo + batch_size
                    batch = [None if a is None else from_numpy(a[lo:hi]) for a in arrays]
                else:
                    batch = list(parts[k])
                batch[at_state], batch[at_next] = state, next_state
                yield (
                    build(batch),
                    tuple(_info_tensor(info[name]) for name in SampleInfo._fields)
                    if with_info
                    else None,
                )
            if whole:
                ahead = min(draws, ahead * 2)

    def draws_per_call(self, batch_size: int) -> int:
        """Batches a torch stream draws per table call: for a table of independent draws
        (`SamplingConfig.independent_draws`) up to `DRAW_BATCHES`, within `DRAW_ITEMS` items
        (`batches.draws_per_call`), else 1."""
        from replay_service.sample.batches import draws_per_call

        if not self.table.config.sampling.independent_draws:
            return 1
        return min(DRAW_BATCHES, draws_per_call(batch_size, self.table.item_bytes, DRAW_ITEMS))


class WorkerSampleSource(PackingSource):
    """A shared local table sampled in a DataLoader worker process (`SharedReader`): uniform
    draws with replacement, read-only, one batch per call, from a generator of the worker's
    own (seeded from the table's seed and the worker id when the manager has `seed=`).

    Args:
      shared: The table's `SharedTable`.
      stored_spec: Per-step stored spec (its structure shapes every batch).
      sample_timeout: Seconds to wait for `min_size_to_sample` items; None: forever.
    """

    server_address = "local"
    fork_safe = True
    ordered = False

    def __init__(self, shared: SharedTable, stored_spec: Any, sample_timeout: float | None) -> None:
        self.shared = shared
        self.table_name = shared.name
        self.sequence_length = shared.length
        self.sample_timeout = sample_timeout
        self.signature = stored_spec

    def __reduce__(self) -> Any:
        return WorkerSampleSource, (self.shared, self.signature, self.sample_timeout)

    def _samples(self, request: SampleRequest) -> TorchSamples:
        """The batches of `torch_samples` (see `PackingSource`): one draw per batch, from a
        reader of this worker's own (`num_workers` is ignored).

        Raises:
          ManagerClosedError: Once the owner closed the table.
          BufferStateError: If nothing can be sampled within `sample_timeout`.
        """
        pack, with_info = request.pack, request.with_info
        worker = get_worker_info()
        reader = self.shared.reader(0 if worker is None else worker.id)
        while True:
            data, info = reader.sample(request.batch_size, self.sample_timeout, with_info=with_info)
            if request.convert is not None:
                data = [request.convert(t) for t in data]
            yield (
                pack.build(list(pack.prepare(data))),
                tuple(_info_tensor(info[name]) for name in SampleInfo._fields)
                if with_info
                else None,
            )


def _info_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype == np.uint64:
        return torch.from_numpy(array.view(np.int64)).view(torch.uint64)
    return torch.from_numpy(array)


def tf_dataset(source: LocalSampleSource, batch_size: int, prefetch: int = 0) -> Any:
    """A tf.data dataset of `(trajectory, SampleInfo)` batches of one local table.

    Leading dimensions are `[batch_size, sequence_length]` (info broadcast along the
    sequence), as `ReplayBufferManager.get_dataset` gives on Reverb. It never ends: when nothing
    can be sampled within the source's timeout, or the manager was closed, iterating raises a
    `tf.errors.OpError` whose message is ours.

    Raises:
      ConfigError: If TensorFlow is not installed.
    """
    tf = require_tensorflow("get_dataset")
    from replay_service.specs.nests import table_signature, to_tf_spec

    length = source.sequence_length
    # TF-Agents' `Trajectory` where the spec has an `array_specs.Trajectory` (`from_spaces`).
    signature = table_signature(to_tf_spec(source._structure), length)
    flat = tree.flatten(signature)
    output_signature = (
        tuple(tf.TensorSpec([batch_size, *s.shape], s.dtype) for s in flat),
        tuple(tf.TensorSpec([batch_size], tf.as_dtype(d)) for d in _INFO_DTYPES),
    )

    def generate() -> Iterator[Any]:
        while True:
            data, info = source.sample(batch_size)
            yield tuple(t.numpy() for t in data), tuple(info[name] for name in SampleInfo._fields)

    def structure(data: Any, info: Any) -> Any:
        broadcast = [tf.repeat(x[:, None], length, axis=1) for x in info]
        return tf.nest.pack_sequence_as(signature, list(data)), SampleInfo(*broadcast)

    dataset = tf.data.Dataset.from_generator(generate, output_signature=output_signature)
    dataset = dataset.map(structure)
    return dataset.prefetch(prefetch) if prefetch else dataset


def require_tensorflow(call: str) -> Any:
    """Imports TensorFlow for `call`, or says what to install.

    Raises:
      ConfigError: If TensorFlow does not import.
    """
    try:
        import tensorflow as tf
    except ImportError as e:
        raise ConfigError(
            f"{call} returns a tf.data dataset and needs TensorFlow, which is not installed "
            f"({e}); use torch_batches()/torch_dataset(), or install tensorflow==2.14.1 "
            "(Python 3.11)"
        ) from e
    return tf


class LocalReplayBuffer:
    """What `create_replay_buffer()` returns on the local backend, in place of TF-Agents'
    `ReverbReplayBuffer`: `as_dataset`, `num_frames` and `clear` of the primary table.

    Args:
      source: The primary table's sample source.
      client_reset: Empties the tables (the manager's `clear`).
    """

    def __init__(self, source: LocalSampleSource, client_reset: Callable[[], None]) -> None:
        self._source = source
        self._reset = client_reset
        self.lifeline = source.lifeline

    @property
    def data_spec(self) -> Any:
        """The per-step stored spec."""
        return self._source._structure

    def num_frames(self) -> int:
        """Items in the primary table."""
        return self._source.table.size

    def as_dataset(
        self,
        sample_batch_size: int | None = None,
        num_steps: int | None = None,
        num_parallel_calls: int | None = None,
        sequence_preprocess_fn: Any = None,
        single_deterministic_pass: bool = False,
    ) -> Any:
        """TF-Agents' `as_dataset` on the local table: `(trajectory, info)` batches.

        Args:
          sample_batch_size: Items per batch (required).
          num_steps: Must be None or the table's sequence length.
          num_parallel_calls: Ignored.
          sequence_preprocess_fn: Must be None.
          single_deterministic_pass: Must be False.

        Raises:
          ConfigError: For options the local backend does not have, a `sample_batch_size`
            above its ceiling (`config.batch_limits.require_batch_size`), or without TensorFlow.
        """
        del num_parallel_calls
        length = self._source.sequence_length
        if sample_batch_size is None or num_steps not in (None, length):
            raise ConfigError(
                f"the local backend's as_dataset needs sample_batch_size and num_steps None or "
                f"{length} (got {sample_batch_size!r}, {num_steps!r})"
            )
        if sequence_preprocess_fn is not None or single_deterministic_pass:
            raise ConfigError(
                "sequence_preprocess_fn and single_deterministic_pass need backend='reverb'"
            )
        require_batch_size(
            "sample_batch_size",
            sample_batch_size,
            self._source.item_bytes,
            what=f"table {self._source.table_name!r}",
        )
        return tf_dataset(self._source, sample_batch_size)

    def clear(self) -> None:
        """Empties the tables."""
        self._reset()

    def stop_sampling(self) -> None:
        """Makes every stream of this buffer fail at its next call."""
        if self.lifeline is not None:
            self.lifeline.close()
