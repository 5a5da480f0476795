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
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
import tree
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from replay_service.backends.reverb import internals as reverb_internals
from replay_service.backends.reverb.handles import TableHandle
from replay_service.config.options import require_int, require_positive_int
from replay_service.errors import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
    ServerUnavailableError,
    SpecMismatchError,
)
from replay_service.specs.arrays import StepType
from replay_service.specs.layouts import NESTED, Layout, resolve_layout, steps_of
from replay_service.specs.packed import PackedLayout, step_layout
from replay_service.specs.windows import Masked

if TYPE_CHECKING:
    import tensorflow as tf

    from replay_service.backends.reverb.liveness import Lifeline

LAST = StepType.LAST
TRANSITION_SEQUENCE_LENGTH = 2
# Batches prepared ahead by a Python thread. None by default: the Reverb pipeline prefetches in
# tf.data's C++ threads, which do not hold the GIL, and a local table is sampled in
# microseconds; a Python thread beside a collecting loop made every `add` wait for the GIL.
DEFAULT_PREFETCH = 0
# Packed steps of at most this many bytes are unpacked in numpy by the torch path (see
# `SampleSource.torch_samples`), larger ones by TensorFlow in the read pipeline.
NUMPY_UNPACK_STEP_BYTES = 4096
# A torch stream of a table of independent draws (`SamplingConfig.independent_draws`) fetches
# up to this many items, and this many bytes, at once (at least one batch), then hands them
# out batch by batch: the per-fetch work (TensorFlow's `GetNext`, the unpacking copies and
# transition flags, or a local table's lock and selection) is paid once for several small
# batches.
DRAW_ITEMS = 256
DRAW_BYTES = 1 << 20
# Samples requested ahead per Reverb worker, in batches (Reverb recommends 2-3x the batch size).
IN_FLIGHT_BATCHES = 2
# Sample streams (one Reverb worker each, batched on their own tf.data thread) behind one
# iterator; samplers whose order matters get one.
SAMPLING_WORKERS = 2
# How often a blocked producer or consumer looks at the stop flag.
POLL_S = 0.1
# How long close() waits for the background thread before leaving it to finish on its own.
JOIN_TIMEOUT_S = 5.0
DEFAULT_MP_CONTEXT = "forkserver"

_ITEM, _END, _ERROR = "item", "end", "error"


def draws_per_call(batch_size: int, item_bytes: int, items: int = DRAW_ITEMS) -> int:
    """Batches of `batch_size` items of `item_bytes` a stream of independent draws fetches at
    once: as many as fit in `items` items (default `DRAW_ITEMS`) and `DRAW_BYTES` bytes, at
    least 1."""
    by_bytes = DRAW_BYTES // max(1, batch_size * item_bytes)
    return max(1, min(items // batch_size, by_bytes))


def split_batches(
    tensors: Sequence[torch.Tensor], batch_size: int, draws: int
) -> list[Sequence[torch.Tensor]]:
    """Per tensor, its `draws` consecutive batches of `batch_size` items (views)."""
    if draws == 1:
        return [(t,) for t in tensors]
    return [t.split(batch_size) for t in tensors]


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


def _server_draws_independently(handle: TableHandle) -> bool:
    """Whether the server's table of `handle` samples independent draws (as configured there,
    which a remote client's config may not match); False if the server does not answer (the
    stream then reports that itself)."""
    import reverb

    from replay_service.backends.reverb.connection import server_info
    from replay_service.backends.reverb.tables import draws_independently

    try:
        tables = server_info(reverb.Client(handle.server_address), handle.timeouts.connect)
    except ServerUnavailableError:
        return False
    info = tables.get(handle.name)
    return info is not None and draws_independently(info)


@dataclasses.dataclass(frozen=True)
class SampleSource:
    """Where to sample from and what the items look like; picklable, holds no connection.

    Attributes:
      server_address: "host:port" of the Reverb server.
      table_name: Table to sample.
      signature: Nest of `tf.TensorSpec` of one item (leading dimension `sequence_length`).
      sequence_length: Steps per item.
      sample_timeout: Seconds to wait for an item before failing; None waits forever.
      ordered: The table's sampler returns items in an order (FIFO, LIFO, heaps), which one
        sampling worker keeps.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check (see
        `datasets.LivenessRules`); None: at most `sample_timeout`.
      lifeline: Closed by the manager's `close()`; a pickled copy keeps the state it had.
      layout: The table's layout; a packed table's rows are unpacked into `signature`'s nest.
        A layout name given here is resolved for `signature`'s steps on construction.
      independent: Every sample is an independent draw (`SamplingConfig.independent_draws`):
        torch streams fetch `draws_per_call` batches at once and hand them out one by one
        (a batch handed out later may miss items inserted since, as any batch sampled ahead).
    """

    server_address: str
    table_name: str
    signature: Any
    sequence_length: int
    sample_timeout: float | None
    ordered: bool = False
    connect_timeout: float | None = None
    lifeline: Lifeline | None = dataclasses.field(default=None, compare=False, repr=False)
    layout: Layout | str = NESTED
    independent: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):
            object.__setattr__(
                self, "layout", resolve_layout(self.layout, steps_of(self.signature))
            )

    @classmethod
    def from_handle(cls, handle: TableHandle, *, lifeline: Lifeline | None = None) -> SampleSource:
        """Describes the table of `handle` (e.g. `manager.table_handle(table)`).

        Args:
          handle: The table.
          lifeline: Its manager's, closed by `close()`; None: streams notice a closed manager
            only when its server is gone.
        """
        return cls(
            server_address=handle.server_address,
            table_name=handle.name,
            signature=handle.signature,
            sequence_length=handle.sequence_length,
            sample_timeout=handle.timeouts.sample,
            ordered=handle.ordered,
            connect_timeout=handle.timeouts.connect,
            lifeline=lifeline,
            layout=handle.layout,
            independent=(
                handle.table.sampling.independent_draws and _server_draws_independently(handle)
            ),
        )

    @property
    def table_layout(self) -> Layout:
        """`layout`, a `Layout` once constructed."""
        layout = self.layout
        assert isinstance(layout, Layout), layout
        return layout

    def tf_dataset(
        self,
        batch_size: int,
        *,
        num_workers: int | None = None,
        unpack: bool = True,
        draws: int = 1,
    ) -> tf.data.Dataset:
        """Returns a dataset of `ReplaySample(info, data)` batches of exactly `batch_size`.

        It is `datasets.read_pipeline`: iterating raises `tf.errors.InvalidArgumentError`
        (rather than blocking) when no item arrives within `sample_timeout`, when the server
        is lost, and once `lifeline` is closed; `iterate_batches` turns those into our errors.

        Args:
          batch_size: Items per batch.
          num_workers: Sample streams behind the iterator (see `datasets.read_pipeline`);
            None: 1 for an ordered sampler, else `SAMPLING_WORKERS`.
          unpack: Whether a packed table's rows are unpacked into `signature`'s nest (False:
            `data` is the batch of packed rows; see `datasets.read_pipeline`).
          draws: Batches fetched at once: the dataset's batches hold `draws * batch_size`
            items; the samples requested ahead stay those of `batch_size`.
        """
        from replay_service.backends.reverb.pipeline import read_pipeline

        if num_workers is None:
            num_workers = 1 if self.ordered else SAMPLING_WORKERS
        return read_pipeline(
            self.server_address,
            self.table_name,
            self.signature,
            batch_size * draws,
            sample_timeout=self.sample_timeout,
            connect_timeout=self.connect_timeout,
            num_workers=num_workers,
            # Every DataLoader worker holds its own window: two batches each.
            max_in_flight=IN_FLIGHT_BATCHES * batch_size,
            lifeline=self.lifeline,
            layout=self.table_layout,
            unpack=unpack,
        )

    def torch_samples(
        self,
        batch_size: int,
        *,
        num_workers: int | None = None,
        convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pack: Packer | None = None,
        with_info: bool = True,
    ) -> Iterator[tuple[Any, tuple[torch.Tensor, ...] | None]]:
        """Samples `tf_dataset` batches as torch tensors (see `TorchSampleSource`).

        Args:
          batch_size: Items per batch.
          num_workers: Sample streams; None chooses (see `tf_dataset`).
          convert: Applied to every data tensor after its conversion to torch.
          pack: Flat data tensors -> what is yielded; None: the item nest.
          with_info: Whether to yield the info tensors (else None).

        Yields:
          `(data, info)` pairs of torch tensors; `info` stays on the CPU.

        Raises:
          BufferStateError: If no item could be sampled within `sample_timeout`.
          ServerUnavailableError: If the server cannot be reached, or was lost while sampling
            (within `liveness.liveness_bound(sample_timeout, connect_timeout)` seconds).
          ManagerClosedError: If the manager was closed (`lifeline`).
        """
        import tensorflow as tf

        from replay_service.backends.reverb.sampling_errors import (
            FOREIGN_ITEM_ERROR,
            foreign_item_message,
            sampling_timeout_message,
        )

        if pack is None:
            pack = item_packer(self.signature)
        info_fields = len(TorchSampleInfo._fields)

        def read_nest(flat: Sequence[Any]) -> list[torch.Tensor]:
            data = [tensor_to_torch(t) for t in flat[info_fields:]]
            if convert is not None:
                data = [convert(t) for t in data]
            return pack.prepare(data)

        def rows_reader(layout: PackedLayout) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
            prepare_rows = pack.prepare_rows
            if prepare_rows is not None:

                def read_kept_rows(flat: Sequence[Any]) -> list[torch.Tensor]:
                    # Reads only the bytes it keeps.
                    rows = reverb_internals.numpy_view(flat[info_fields])
                    prepared = prepare_rows(layout, rows)
                    return prepared if convert is None else [convert(t) for t in prepared]

                return read_kept_rows

            def read_rows(flat: Sequence[Any]) -> list[torch.Tensor]:
                rows = reverb_internals.numpy_view(flat[info_fields])
                data = [torch.from_numpy(a) for a in layout.unpack_leaves(rows, copy=True)]
                if convert is not None:
                    data = [convert(t) for t in data]
                return pack.prepare(data)

            return read_rows

        # A packed table of small steps has its rows unpacked here, in numpy (one copy per
        # field, or only of the steps a packer keeps: `Packer.prepare_rows`), rather than by
        # TF ops in the pipeline: about 7 ops per field per batch, which cost the pipeline's
        # threads more CPU than the copies (a training loop shares the cores with them).
        # Large steps stay with TF, whose allocator reuses the batch memory that fresh numpy
        # copies would fault in page by page (image batches sampled 3x slower).
        read_batch, unpack = self.table_layout.batch_reader(
            NUMPY_UNPACK_STEP_BYTES, read_nest, rows_reader
        )
        draws = 1
        if self.independent:
            item_bytes = step_layout(self.signature).step_bytes * self.sequence_length
            draws = draws_per_call(batch_size, item_bytes)

        def open_pipeline() -> Callable[[], Any]:
            dataset = self.tf_dataset(
                batch_size, num_workers=num_workers, unpack=unpack, draws=draws
            )
            return reverb_internals.flat_getter(dataset)

        get_next = open_pipeline()
        clears = self._clears()
        while True:
            # Batches the pipeline already holds must not outlive close().
            closed = self.closed_error()
            if closed is not None:
                raise closed
            if self._clears() != clears:
                # The manager emptied the table: drop what the pipeline sampled before that.
                get_next, clears = open_pipeline(), self._clears()
            try:
                flat = get_next()
            except (StopIteration, tf.errors.OutOfRangeError):
                raise BufferStateError(
                    sampling_timeout_message(self.table_name, self.sample_timeout)
                ) from None
            except tf.errors.UnavailableError as e:
                raise ServerUnavailableError(
                    f"sampling table {self.table_name!r} from {self.server_address!r} failed: "
                    f"{e.message}"
                ) from e
            except tf.errors.InvalidArgumentError as e:
                if FOREIGN_ITEM_ERROR in (e.message or ""):
                    raise SpecMismatchError(foreign_item_message(self.table_name, e.message)) from e
                ours = _sampling_error(e)
                if ours is None:
                    raise
                raise ours from e
            prepared = read_batch(flat)
            parts = split_batches(prepared, batch_size, draws)
            info_parts = None
            if with_info:
                info = [tensor_to_torch(t) for t in flat[:info_fields]]
                info_parts = split_batches(info, batch_size, draws)
            for k in range(draws):
                if k:
                    closed = self.closed_error()
                    if closed is not None:
                        raise closed
                    if self._clears() != clears:
                        break  # the rest of this block was sampled before a clear()
                yield (
                    pack.build([part[k] for part in parts]),
                    None if info_parts is None else tuple(part[k] for part in info_parts),
                )

    def _clears(self) -> int:
        return 0 if self.lifeline is None else self.lifeline.clears

    def clears(self) -> int:
        """How many times the manager emptied the table (a stream holding items sampled
        before a change drops them)."""
        return self._clears()

    def closed_error(self) -> ManagerClosedError | None:
        """The error every stream of this source raises once its manager was closed, else None."""
        if self.lifeline is None or not self.lifeline.closed:
            return None
        from replay_service.backends.reverb.liveness import MANAGER_CLOSED_MESSAGE

        return ManagerClosedError(
            f"{MANAGER_CLOSED_MESSAGE} (server {self.server_address}, table {self.table_name}): "
            "datasets and batch streams stop with their ReplayBufferManager; create a new "
            "manager, load the buffer and ask it for a new batch stream."
        )


@dataclasses.dataclass(frozen=True)
class TransitionBatch:
    """One batch of transitions, read from 2-step TF-Agents `Trajectory` windows.

    A TF-Agents trajectory step `t` holds `step_type[t]`, `observation[t]`, `action[t]` and
    `policy_info[t]` together with what followed the action: `reward[t]`, `discount[t]` and
    `next_step_type[t]`. An episode ends after step `t` when `next_step_type[t]` is LAST; the
    step after it is the boundary step holding the episode's final observation. Environment
    termination gives `discount 0`; a time limit (truncation) keeps `discount 1`. For a window
    `[:, 0:2]` this gives, per item:

    - `states` = `observation[:, 0]`, `actions` = `action[:, 0]`, `rewards` = `reward[:, 0]`,
      `next_states` = `observation[:, 1]` (each a nest if the spec's field is one);
    - `dones` = `next_step_type[:, 0] == LAST and discount[:, 0] == 0`: the transition
      reached a terminal state; do not bootstrap from `next_states`;
    - `truncated` = `next_step_type[:, 0] == LAST and discount[:, 0] != 0`: the episode ended
      without termination (e.g. a time limit); `next_states` is its real final observation,
      bootstrap from it as from any other;
    - `hiddens` = `policy_info[:, 0]` (a nest), or None when the spec's `policy_info` is empty.

    `dones` and `truncated` are `torch.bool` of shape `[batch]`, never both True. The seeds'
    `dones = terminated | truncated` is `dones | truncated`. Windows written by replay_service
    never start at a boundary step, so every item is a real transition. A field whose step
    holds at most `STEP_COPY_BYTES` per item (vectors, scalars) is a contiguous copy of its
    step (a small network's forward and backward pass over strided views of the windows costs
    more than the copy: measured with the benchmark's training loop); larger ones (images) are
    views into the sampled windows. `rewards` keeps the spec's shape (`[batch]` for a scalar).

    Attributes:
      states: Observations before the action.
      actions: Actions taken.
      rewards: Rewards received for them.
      next_states: Observations after the action.
      dones: The transition terminated the episode.
      truncated: The transition ended the episode without terminating it.
      hiddens: Policy info (e.g. an actor's hidden state), or None.
    """

    states: Any
    actions: Any
    rewards: torch.Tensor
    next_states: Any
    dones: torch.Tensor
    truncated: torch.Tensor
    hiddens: Any | None


class TorchSampleInfo(NamedTuple):
    """Reverb's per-item sample info as tensors of shape `[batch]`.

    Attributes:
      key: Item keys (`torch.uint64`), e.g. for `py_client.mutate_priorities`.
      probability: Probability of selecting each item (`float64`).
      table_size: Items in the table when sampled (`int64`).
      priority: Priority of each item (`float64`).
      times_sampled: Times each item was sampled, this time included (`int32`).
    """

    key: torch.Tensor
    probability: torch.Tensor
    table_size: torch.Tensor
    priority: torch.Tensor
    times_sampled: torch.Tensor


def to_transitions(trajectory: Any) -> TransitionBatch:
    """Turns a batch of 2-step trajectory windows (torch tensors) into a `TransitionBatch`.

    Args:
      trajectory: A TF-Agents `Trajectory` of tensors shaped `[batch, 2, ...]`.

    Returns:
      The transitions; see `TransitionBatch` for the exact semantics.

    Raises:
      ConfigError: If the windows do not have exactly 2 steps.
    """
    _check_transition_steps(trajectory.step_type.shape[1])
    dones, truncated = _episode_flags(trajectory.next_step_type, trajectory.discount)
    policy_info = trajectory.policy_info
    return TransitionBatch(
        states=_step(trajectory.observation, 0),
        actions=_step(trajectory.action, 0),
        rewards=_step(trajectory.reward, 0),
        next_states=_step(trajectory.observation, 1),
        dones=dones,
        truncated=truncated,
        hiddens=_step(policy_info, 0) if tree.flatten(policy_info) else None,
    )


_TRANSITION_FIELDS = ("step_type", "observation", "action", "policy_info", "next_step_type")
_TRANSITION_SCALARS = ("step_type", "next_step_type", "reward", "discount")


@dataclasses.dataclass(frozen=True)
class Packer:
    """Turns a batch's flat data tensors (in `tree.flatten(signature)` order) into what a
    stream yields: `build(prepare(flat))`, also `packer(flat)`.

    `prepare` does the per-batch work on whole tensors and returns flat tensors whose first
    dimension is still the batch, so a source that draws several batches at once prepares
    them together and builds each from slices (`build([t[a:b] for t in prepared])`).

    Attributes:
      prepare: Flat data tensors -> flat tensors `[batch, ...]`.
      build: Those (or slices of them along the batch) -> the yielded object.
      prepare_rows: Optionally, `prepare` of a batch of a packed table given as its rows
        (`PackedLayout`, numpy `uint8[batch, sequence_length, step_bytes]`), copying only the
        bytes it keeps instead of unpacking every field first; None: unpack, then `prepare`.
      steps: Optionally, the `(flat field, step)` pairs of windows of
        `TRANSITION_SEQUENCE_LENGTH` steps that `prepare_steps` needs: a source that reads
        single steps (a local table) reads only those, one tensor `[batch, ...]` per pair,
        instead of every field's window. Windows of other lengths go through `prepare`.
      prepare_steps: `prepare` of those tensors (set with `steps`).
    """

    prepare: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    build: Callable[[Sequence[torch.Tensor]], Any]
    prepare_rows: Callable[[PackedLayout, np.ndarray], list[torch.Tensor]] | None = None
    steps: tuple[tuple[int, int], ...] | None = None
    prepare_steps: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None = None

    def __call__(self, flat: Sequence[torch.Tensor]) -> Any:
        return self.build(self.prepare(flat))


def item_packer(structure: Any) -> Packer:
    """A `Packer` of the item nest of `structure` (`nest_packer`)."""
    return Packer(list, nest_packer(structure))


def transition_packer(structure: Any) -> Packer:
    """A `Packer` of `TransitionBatch`: `packer(flat)` equals
    `to_transitions(nest_packer(structure)(flat))`, with the positions of the fields in the
    flat list found once.

    Args:
      structure: The item nest: a TF-Agents `Trajectory` (any namedtuple with its fields).
        Other nests (e.g. the `Masked` items of padded tables), and trajectories whose
        reward, discount or step types are nests, are packed and passed to `to_transitions`
        (which takes a nested reward; the others fail there as they are not trajectories).
    """
    nested = nest_packer(structure)
    fields = getattr(type(structure), "_fields", ())
    positions = tree.unflatten_as(structure, list(range(len(tree.flatten(structure)))))
    if not (
        isinstance(structure, tuple)
        and set(_TRANSITION_FIELDS) | {"reward", "discount"} <= set(fields)
        and all(not tree.is_nested(getattr(positions, f)) for f in _TRANSITION_SCALARS)
    ):
        return Packer(list, lambda flat: to_transitions(nested(flat)))
    step_type, next_step_type, reward, discount = (
        getattr(positions, f) for f in _TRANSITION_SCALARS
    )
    observations = tree.flatten(positions.observation)
    actions = tree.flatten(positions.action)
    hiddens = tree.flatten(positions.policy_info)
    # The prepared list: states, actions, reward (first steps), next states (second steps),
    # dones, truncated, hiddens (first steps).
    first_steps = [*observations, *actions, reward]
    n_obs = len(observations)
    pack_states = nest_packer(structure.observation)
    pack_actions = nest_packer(structure.action)
    pack_hiddens = nest_packer(structure.policy_info)
    at_reward = n_obs + len(actions)
    at_next = at_reward + 1
    at_dones = at_next + n_obs
    at_hiddens = at_dones + 2

    def prepare(flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        _check_transition_steps(flat[step_type].shape[1])
        dones, truncated = _episode_flags(flat[next_step_type], flat[discount])
        return [
            *(step_of(flat[i], 0) for i in first_steps),
            *(step_of(flat[i], 1) for i in observations),
            dones,
            truncated,
            *(step_of(flat[i], 0) for i in hiddens),
        ]

    def prepare_rows(layout: PackedLayout, rows: np.ndarray) -> list[torch.Tensor]:
        _check_transition_steps(rows.shape[1])
        first, second = rows[:, 0], rows[:, 1]
        ends = layout.leaf(first, next_step_type) == LAST
        terminated = ends & (layout.leaf(first, discount) == 0)
        return [
            *(torch.from_numpy(layout.leaf(first, i)) for i in first_steps),
            *(torch.from_numpy(layout.leaf(second, i)) for i in observations),
            torch.from_numpy(terminated),
            torch.from_numpy(ends ^ terminated),
            *(torch.from_numpy(layout.leaf(first, i)) for i in hiddens),
        ]

    # The steps kept (as `prepare` keeps them), then the two that give the flags.
    kept = (*((i, 0) for i in first_steps), *((i, 1) for i in observations))
    steps = (*kept, (next_step_type, 0), (discount, 0), *((i, 0) for i in hiddens))

    def prepare_steps(read: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        dones, truncated = _step_flags(read[len(kept)], read[len(kept) + 1])
        return [*read[: len(kept)], dones, truncated, *read[len(kept) + 2 :]]

    def build(prepared: Sequence[torch.Tensor]) -> TransitionBatch:
        return TransitionBatch(
            states=pack_states(prepared[:n_obs]),
            actions=pack_actions(prepared[n_obs:at_reward]),
            rewards=prepared[at_reward],
            next_states=pack_states(prepared[at_next:at_dones]),
            dones=prepared[at_dones],
            truncated=prepared[at_dones + 1],
            hiddens=pack_hiddens(prepared[at_hiddens:]) if hiddens else None,
        )

    return Packer(prepare, build, prepare_rows, steps, prepare_steps)


def _check_transition_steps(steps: int) -> None:
    if steps != TRANSITION_SEQUENCE_LENGTH:
        raise ConfigError(
            f"transitions need windows of {TRANSITION_SEQUENCE_LENGTH} steps, got {steps}; "
            "sample nested trajectories instead (transitions=False)"
        )


def nest_packer(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """Returns `pack(flat)`, equal to `tree.unflatten_as(structure, flat)`, built once.

    Tuples, lists, namedtuples and dicts (keys in sorted order, as `tree` flattens them) are
    rebuilt by calls made ahead for this structure; `tree.unflatten_as` walks and checks the
    whole structure on every call (about 10 us for a `Trajectory`, per batch). Other nests
    (attrs classes, mappings that are not dicts...) fall back to `tree.unflatten_as`.

    Args:
      structure: The nest (its leaves are ignored).
    """
    count = len(tree.flatten(structure))
    position = 0

    def build(node: Any) -> Callable[[Sequence[Any]], Any] | None:
        nonlocal position
        if not tree.is_nested(node):
            index = position
            position += 1
            return operator.itemgetter(index)
        kind = type(node)
        if kind in (tuple, list) or (isinstance(node, tuple) and hasattr(kind, "_fields")):
            parts = [build(child) for child in node]
            if any(part is None for part in parts):
                return None
            if kind is tuple:
                return lambda flat: tuple([part(flat) for part in parts])
            if kind is list:
                return lambda flat: [part(flat) for part in parts]
            return lambda flat: kind(*[part(flat) for part in parts])
        if kind is dict:
            keys = sorted(node)
            parts = [build(node[key]) for key in keys]
            if any(part is None for part in parts):
                return None
            return lambda flat: {key: part(flat) for key, part in zip(keys, parts, strict=True)}
        return None

    pack = build(structure)
    if pack is None or position != count:
        return lambda flat: tree.unflatten_as(structure, list(flat))
    return pack


def _episode_flags(
    next_step_type: torch.Tensor, discount: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dones, truncated)` of the first step of each window (`_step_flags`)."""
    return _step_flags(next_step_type[:, 0], discount[:, 0])


def _step_flags(
    next_step_type: torch.Tensor, discount: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dones, truncated)` of a batch of steps `[batch]`: a transition that ends its episode
    (next step LAST) terminated if its discount is 0, else it was truncated.

    On the CPU the flags are computed in numpy (a few microseconds for a batch against about
    25 for the same torch calls, once per batch of a training loop), elsewhere in torch.
    """
    if next_step_type.device.type == "cpu" and discount.device.type == "cpu":
        ends = next_step_type.numpy() == LAST
        terminated = ends & (discount.numpy() == 0)
        return torch.from_numpy(terminated), torch.from_numpy(ends ^ terminated)
    ends = next_step_type == LAST
    continuing = discount != 0
    return ends & ~continuing, ends & continuing


def _step(value: Any, index: int) -> Any:
    """Step `index` of every tensor of `value` (a tensor or a nest): `step_of` each."""
    if isinstance(value, torch.Tensor):
        return step_of(value, index)
    return tree.map_structure(lambda x: step_of(x, index), value)


# Steps of at most this many bytes per item are copied out of their windows; larger ones
# (images) stay views, which a learner's first operation (a cast, a scale) copies anyway.
STEP_COPY_BYTES = 4096


def step_of(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """`tensor[:, index]`: a contiguous copy if one item's step holds at most
    `STEP_COPY_BYTES` (on the CPU through numpy: about 2 us for a small batch, against 3 for
    torch's own calls; pinned memory stays pinned), else a view."""
    if math.prod(tensor.shape[2:]) * tensor.element_size() > STEP_COPY_BYTES:
        return tensor.select(1, index)
    pinned = tensor.is_pinned()
    if tensor.device.type == "cpu" and not pinned:
        try:
            return torch.from_numpy(tensor.numpy()[:, index].copy())
        except (TypeError, RuntimeError):  # no numpy view: autograd, bfloat16, conjugate...
            pass
    step = tensor.select(1, index).contiguous()
    return step.pin_memory() if pinned else step


def tensor_to_torch(value: tf.Tensor) -> torch.Tensor:
    """Hands an eager CPU tensor to torch without copying.

    The tensor's buffer is shared through its numpy view (about 1 us, every dtype, bool
    included), which keeps the tensor alive; DLPack does the same for most dtypes but turns
    bool into uint8 and, through TF's Python wrapper, costs more per call.

    Args:
      value: An eager `tf.Tensor`.

    Returns:
      A CPU `torch.Tensor` sharing the data (a copy if the tensor is not in host memory).
    """
    return torch.from_numpy(reverb_internals.numpy_view(value))


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


def _sampling_error(error: tf.errors.InvalidArgumentError) -> Exception | None:
    """Our exception for an error raised by the read pipeline's bounds; None for others."""
    from replay_service.backends.reverb.liveness import MANAGER_CLOSED_MESSAGE, SERVER_LOST_MESSAGE
    from replay_service.backends.reverb.sampling_errors import (
        EMPTY_BUFFER_MESSAGE,
        replay_service_message,
    )

    message = replay_service_message(error)
    if message is None:
        return None
    if message.startswith(SERVER_LOST_MESSAGE):
        return ServerUnavailableError(message)
    if message.startswith(MANAGER_CLOSED_MESSAGE):
        return ManagerClosedError(message)
    if message.startswith(EMPTY_BUFFER_MESSAGE):
        return BufferStateError(message)
    return None


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
        _check_sizes(batch_size, transitions, source)
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
        _check_sizes(batch_size, transitions, source)
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


def _check_sizes(batch_size: int, transitions: bool, source: TorchSampleSource) -> None:
    require_positive_int("batch_size", batch_size, maximum=None)
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


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from e
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but CUDA is not available")
    return target


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
