"""The Reverb table as a torch sample source: its tf.data read pipeline, handed to torch.

`SampleSource` (a `sample.torch_streams.TorchSampleSource`) is picklable and holds no
connection: a `reverb.TrajectoryDataset` batched by tf.data (`pipeline.read_pipeline`) is
iterated eagerly once sampling starts (TensorFlow is imported then, not before), and each
batched field is handed to torch through its numpy view, without a copy (`tensor_to_torch`).
The streams that sample it live in `replay_service.sample.torch_streams`, what a batch is built
into (the packers, `TransitionBatch`) in `replay_service.sample.batches`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from replay_service.backends.reverb import internals as reverb_internals
from replay_service.backends.reverb.handles import TableHandle
from replay_service.errors import (
    BufferStateError,
    ManagerClosedError,
    ServerUnavailableError,
    SpecMismatchError,
)
from replay_service.sample.batches import TorchSampleInfo, draws_per_call, split_batches
from replay_service.sample.sources import PackingSource, SampleRequest, TorchSamples, hand_out
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.layouts import NESTED, Layout, steps_of
from replay_service.specs.packed import PackedLayout, step_layout

if TYPE_CHECKING:
    import tensorflow as tf

    from replay_service.backends.base import Lifeline

# Packed steps of at most this many bytes are unpacked in numpy by the torch path (see
# `SampleSource.torch_samples`), larger ones by TensorFlow in the read pipeline.
NUMPY_UNPACK_STEP_BYTES = 4096
# Samples requested ahead per Reverb worker, in batches (Reverb recommends 2-3x the batch size).
IN_FLIGHT_BATCHES = 2
# Sample streams (one Reverb worker each, batched on their own tf.data thread) behind one
# iterator; samplers whose order matters get one.
SAMPLING_WORKERS = 2


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
class SampleSource(PackingSource):
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

    def _samples(self, request: SampleRequest) -> TorchSamples:
        """The batches of `torch_samples` (see `PackingSource`): `tf_dataset` batches as torch
        tensors; `num_workers` is `tf_dataset`'s (None chooses), `convert` is applied to every
        data tensor after its conversion to torch, and `info` stays on the CPU.

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

        batch_size, convert, pack = request.batch_size, request.convert, request.pack
        info_fields = len(TorchSampleInfo._fields)

        def read_nest(flat: Sequence[Any]) -> list[torch.Tensor]:
            data = [tensor_to_torch(t) for t in flat[info_fields:]]
            if convert is not None:
                data = [convert(t) for t in data]
            return pack.prepare(data)

        def rows_reader(layout: PackedLayout) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
            prepare_rows = pack.prepare_rows
            if prepare_rows is not None and layout.steps_apart:

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
                batch_size, num_workers=request.num_workers, unpack=unpack, draws=draws
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
            if request.with_info:
                info = [tensor_to_torch(t) for t in flat[:info_fields]]
                info_parts = split_batches(info, batch_size, draws)
            # The rest of a block sampled before a clear() is dropped.
            yield from hand_out(self, pack, parts, info_parts, draws, clears)

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
