"""`ReverbBackend`: what the embedded and the remote Reverb backends share, all but the lifecycle.

The Reverb backend keeps a buffer's tables on one Reverb server, embedded or remote.
`ReverbBackend` holds what both modes share (checking the server's tables, the tf.data and
PyTorch pipelines, export and import through Reverb); its two modes differ in lifecycle only:

- `EmbeddedBackend` (`backends/reverb/embedded.py`): a `CheckpointedServer` in this process,
  owning `checkpoint_dir`.
- `RemoteBackend` (`backends/reverb/remote.py`): a running `replay-server` (or any Reverb server
  with the same tables), which owns its checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import reverb

from replay_service.backends.base import (
    Backend,
    BackendOptions,
    Capability,
)
from replay_service.backends.reverb import transfer
from replay_service.backends.reverb.connection import server_info
from replay_service.backends.reverb.handles import TableHandle
from replay_service.backends.reverb.platform import inspect_patch
from replay_service.config.options import TableConfig
from replay_service.errors import SpecMismatchError
from replay_service.sample.view import DatasetRequest, MixRequest
from replay_service.specs import nests as specs
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.layouts import Layout
from replay_service.storage import export as export_lib
from replay_service.storage import export_target

if TYPE_CHECKING:
    import tensorflow as tf

inspect_patch.patch_inspect()  # lets PolicySaver save policies (see inspect_patch)


class ReverbBackend(Backend):
    """What the embedded and the remote Reverb backends share: everything but the lifecycle.

    Args:
      options: The tables (the primary one first), the per-step `data_spec`, what each step
        stores (`stored_spec`: `data_spec`, or `Masked` for padded tables; None: `data_spec`)
        and the `timeouts` bounding blocking calls; every table stores steps in the layout of
        the primary one (`options_layout`).
    """

    kind = "reverb"
    capabilities = frozenset(
        {
            Capability.SPLIT_SEQUENCES,
            Capability.MIXED_DATASET,
            Capability.TRAIN_SCHEDULE,
            Capability.TABLE_HANDLE,
            Capability.PACKED_LAYOUT,
        }
    )
    description = "a Reverb server"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options.tables, options_layout(options))
        self._data_spec = options.data_spec
        stored_spec = options.stored_spec
        self._stored_spec = options.data_spec if stored_spec is None else stored_spec
        self._timeouts = options.timeouts
        self._client: reverb.Client | None = None

    @classmethod
    def from_options(cls, options: BackendOptions) -> ReverbBackend:
        """The backend of `options` (nothing is started or contacted before `create`/`load`)."""
        return cls(options)

    @classmethod
    def way_out(cls, capability: Capability) -> str:
        """What to use instead where this backend lacks `capability`."""
        if capability in (
            Capability.MEMMAP_STORAGE,
            Capability.SEEDED_SAMPLING,
            Capability.DEVICE_STORAGE,
        ):
            return "it applies only to backend='local'"
        if capability is Capability.COMPRESSION:
            return (
                "Reverb compresses its chunks itself (zstd); leave compression=None, or use "
                "backend='local'"
            )
        if capability is Capability.RECENT_SAMPLING:
            return (
                "use backend='local', or approximate it on Reverb with an extra table of a "
                "small capacity (its FIFO remover keeps only the newest items) and "
                "torch_batches(table=...)"
            )
        return "it needs an embedded Reverb server (no server_address)"

    def replay_buffer_kwargs(self) -> dict[str, Any]:
        """How TF-Agents' `ReverbReplayBuffer` reaches the server."""
        raise NotImplementedError

    def open_buffer(self, client: Any, clear: Callable[[], None]) -> Any:
        """Checks every table on the server against this buffer; returns a `ReplayBuffer`.

        Raises:
          SpecMismatchError: If a table is missing, has no signature, or differs (named).
        """
        from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer

        del clear  # TF-Agents' `clear()` of the returned buffer resets the table itself
        for table in self._configs:
            self._check_table(client, table)
        primary = self._configs[0]
        replay_buffer = ReplayBuffer(
            self._stored_spec,
            primary.name,
            primary.sequence_length,
            sample_timeout=self._timeouts.sample,
            layout=self._layout,
            **self.replay_buffer_kwargs(),
        )
        # TF-Agents' observers are given `replay_buffer.py_client`: it writes as ours does.
        replay_buffer._py_client = self.users_client(replay_buffer._py_client)
        return replay_buffer

    def users_client(self, client: Any) -> Any:
        """The client handed to users (and TF-Agents' observers): a `BoundedClient`, whose
        blocking calls are bounded by this buffer's timeouts and whose priorities are checked
        whole before any is sent; on a packed layout a
        `PackingClient` (one, whose trajectory writers also pack what TF-Agents' observers
        append)."""
        from replay_service.backends.reverb.bounded_client import BoundedClient
        from replay_service.backends.reverb.packing_client import PackingClient
        from replay_service.specs.packed import PackedLayout

        if isinstance(client, BoundedClient):
            return client
        if not isinstance(self._layout, PackedLayout):
            return BoundedClient(client, self._timeouts)
        lengths = {table.name: table.sequence_length for table in self._configs}
        return PackingClient(client, self._layout, lengths, self._timeouts)

    def _check_table(self, client: Any, table: TableConfig) -> None:
        info = check_table_exists(client, table.name, self._timeouts.connect)
        signature = self._layout.item_signature(table.sequence_length)
        if info.signature is None:
            raise SpecMismatchError(
                f"table {table.name!r} at {client.server_address!r} has no signature; "
                "replay_service needs one to check data and build datasets"
            )
        problems = specs.diff_descriptions(
            specs.describe_spec(signature), specs.describe_spec(info.signature)
        )
        if problems:
            problems[:0] = self._layout.mismatch_notes()
        if info.max_size != table.capacity:
            problems.append(f"capacity: requested {table.capacity}, found {info.max_size}")
        if problems:
            raise SpecMismatchError(
                f"table {table.name!r} at {client.server_address!r} does not match this "
                "manager (the leading dimension of each field is sequence_length): "
                + "; ".join(problems)
            )

    def num_items(self, client: Any, table: str) -> int:
        """The table's current size, as the server reports it."""
        return int(check_table_exists(client, table, self._timeouts.connect).current_size)

    def dataset(self, replay_buffer: Any, request: DatasetRequest) -> tf.data.Dataset:
        """Whole items through the tuned pipeline (`pipeline.sample_dataset`); other
        `num_steps` split items with TF-Agents' pipeline."""
        from replay_service.backends.reverb.pipeline import sample_dataset
        from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer

        table, batch_size, num_steps = request.table, request.batch_size, request.num_steps
        if num_steps not in (None, table.sequence_length):
            # Splitting items into shorter sequences: TF-Agents' pipeline does that.
            if table is not self._configs[0]:
                lifeline = replay_buffer.lifeline
                replay_buffer = ReplayBuffer(
                    self._stored_spec,
                    table.name,
                    table.sequence_length,
                    sample_timeout=self._timeouts.sample,
                    server_address=self._require_client().server_address,
                    connect_timeout=self._timeouts.connect,
                    layout=self._layout,
                )
                replay_buffer.lifeline = lifeline
            dataset = replay_buffer.as_dataset(
                sample_batch_size=batch_size,
                num_steps=num_steps,
                num_parallel_calls=min(request.num_parallel_calls, batch_size),
            )
        else:
            ordered = table.sampling.sampler in ("fifo", "lifo", "max_heap", "min_heap")
            dataset = sample_dataset(
                self._require_client().server_address,
                table.name,
                self._stored_spec,
                table.sequence_length,
                batch_size,
                sample_timeout=self._timeouts.sample,
                num_workers=1 if ordered else 2,
                connect_timeout=self._timeouts.connect,
                lifeline=replay_buffer.lifeline,
                layout=self._layout,
            )
        return dataset.prefetch(request.prefetch)

    def mixed_dataset(self, replay_buffer: Any, request: MixRequest) -> tf.data.Dataset:
        """Batches mixing this buffer's tables (`mixing.mixed_dataset`)."""
        from replay_service.backends.reverb.mixing import mixed_dataset

        dataset = mixed_dataset(
            self._require_client().server_address,
            self._configs,
            request.weights,
            self._stored_spec,
            request.batch_size,
            sample_timeout=self._timeouts.sample,
            seed=request.seed,
            connect_timeout=self._timeouts.connect,
            lifeline=replay_buffer.lifeline,
            layout=self._layout,
        )
        return dataset.prefetch(request.prefetch)

    def torch_source(self, replay_buffer: Any, table: TableConfig) -> Any:
        """A `SampleSource` of the table on this server, ended by the buffer's lifeline."""
        from replay_service.backends.reverb.torch_source import SampleSource

        return SampleSource.from_handle(self.table_handle(table), lifeline=replay_buffer.lifeline)

    def note_clear(self, replay_buffer: Any) -> None:
        """Torch streams of Reverb tables drop the blocks they fetched before the clear."""
        replay_buffer.lifeline.cleared()

    def export(
        self, table: TableConfig, dirpath: str, prefix: str, overwrite: bool
    ) -> tuple[str, str]:
        """Exports the table from a checkpoint taken now: its items read once
        (`transfer.read_items`), written by `storage.export.write_export`; the directory is
        checked again before they are read."""
        handle, checkpoint_path = self.table_handle(table), self.checkpoint()
        export_target.export_paths(dirpath, prefix)
        export_target.check_target(os.fspath(dirpath), overwrite)
        items = transfer.read_items(handle, checkpoint_path)
        return export_lib.write_export(
            dirpath, prefix, handle.table, handle.stored_spec, items, overwrite
        )

    def read_items(self, table: TableConfig) -> export_lib.ExportedItems:
        """The items of a checkpoint taken now (`transfer.read_items`): it becomes the newest
        checkpoint, as with `export`."""
        return transfer.read_items(self.table_handle(table), self.checkpoint())

    def insert_items(self, table: TableConfig, items: export_lib.ExportedItems) -> None:
        """Writes the items through Reverb, in order (`transfer.insert_items`), with the item
        writers of the users' client (`BoundedClient.item_writer`)."""
        transfer.insert_items(
            self.users_client(self._require_client()),
            table.name,
            table.sequence_length,
            items,
            self._timeouts,
            self._layout,
        )

    def limiter_state(self, table: str) -> Any:
        """The table's rate limiter, read from the server (`rate_limit.LimiterState`)."""
        from replay_service.sample import rate_limit

        client = self._require_client()
        return rate_limit.LimiterState.from_info(
            check_table_exists(client, table, self._timeouts.connect)
        )

    def table_handle(self, table: TableConfig) -> TableHandle:
        """A picklable description of `table` on this server."""
        return TableHandle(
            server_address=self._require_client().server_address,
            table=table,
            stored_spec=self._stored_spec,
            timeouts=self._timeouts,
            layout=self._layout,
        )

    def _require_client(self) -> reverb.Client:
        assert self._client is not None, "create() or load() first"
        return self._client


def options_layout(options: BackendOptions) -> Layout:
    """How the tables of `options` store steps: the primary table's `layout` (and its
    `frame_stack`), resolved for the stored spec (`specs.layout_registry.resolve_layout`).

    Raises:
      ConfigError: If the layout is not a layout name.
    """
    primary = options.tables[0]
    return resolve_layout(
        primary.layout,
        options.stored_spec,
        frame_stack=primary.frame_stack,
        frame_axis=primary.frame_axis,
    )


def check_table_exists(client: reverb.Client, name: str, timeout: float | None) -> Any:
    """Returns the `TableInfo` of `name` on the server behind `client`.

    Raises:
      SpecMismatchError: If the server has no such table.
      ServerUnavailableError: If it does not answer in time.
    """
    infos = server_info(client, timeout)
    if name not in infos:
        raise SpecMismatchError(
            f"server at {client.server_address!r} has no table {name!r}; "
            f"its tables are {sorted(infos)}"
        )
    return infos[name]
