"""TF-Agents' `ReverbReplayBuffer` whose datasets fail clearly instead of waiting forever.

`ReplayBuffer.as_dataset` is TF-Agents' pipeline (which also splits stored sequences into
shorter ones, `num_steps`) bounded by `sampling_errors.bound_sampling`; the sharded datasets
are built from it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tf_agents.replay_buffers import reverb_replay_buffer

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.layout_datasets import sequence_preprocess
from replay_service.backends.reverb.sampling_errors import bound_sampling, sampling_timeout_message
from replay_service.config.batch_limits import require_batch_size
from replay_service.config.options import to_ms
from replay_service.errors import ConfigError
from replay_service.specs.framed import FramedLayout
from replay_service.specs.layout_registry import as_layout
from replay_service.specs.layouts import NESTED, Layout
from replay_service.specs.packed import layout_of


class ReplayBuffer(reverb_replay_buffer.ReverbReplayBuffer):
    """TF-Agents' `ReverbReplayBuffer` whose datasets fail clearly instead of waiting forever.

    `as_dataset` is TF-Agents' pipeline bounded by `bound_sampling`: iterating raises
    `tf.errors.InvalidArgumentError` when no item arrives within `sample_timeout`, when the
    server has been lost for `sample_timeout` (within `liveness_bound(sample_timeout,
    connect_timeout)` seconds), and after `stop_sampling()`. Everything else (`num_frames`,
    `py_client`, `clear`...) is TF-Agents'.

    Args:
      data_spec: Per-step data spec.
      table_name: Table to sample.
      sequence_length: Steps per item.
      sample_timeout: Seconds to wait for an item before the dataset raises; None waits forever.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check; None: at most
        `sample_timeout`.
      layout: The table's layout, or its name (resolved for `data_spec`, see
        `specs.layout_registry.resolve_layout`): a packed table's items are read as `uint8` rows and
        unpacked into `data_spec`'s nest before TF-Agents' pipeline sees them.
      **kwargs: Passed to `ReverbReplayBuffer` (`server_address` or `local_server`, ...).
    """

    def __init__(
        self,
        data_spec: Any,
        table_name: str,
        sequence_length: int,
        *,
        sample_timeout: float | None,
        connect_timeout: float | None = None,
        layout: Layout | str = NESTED,
        **kwargs: Any,
    ) -> None:
        timeout_ms = to_ms(sample_timeout)
        super().__init__(
            data_spec,
            table_name,
            sequence_length,
            rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
            **kwargs,
        )
        self._sample_timeout = sample_timeout
        self._connect_timeout = connect_timeout
        self._layout = as_layout(layout, data_spec)
        self.lifeline = Lifeline()

    def stop_sampling(self) -> None:
        """Makes every dataset built from this buffer (and lent its lifeline) fail.

        Called by `ReplayBufferManager.close()`; each such dataset raises at its next watch
        round (within a tenth of a second, or one liveness check) instead of blocking.
        """
        self.lifeline.close()

    # Datasets built inside tf.data functions (the sharded mixture's flat_map) would otherwise
    # be converted by AutoGraph, whose rewrite of a zero-argument super() looks the class up by
    # walking every stack frame's locals; depending on what ran before in the process, that
    # lookup failed with a TypeError from the converted __init__.
    @tf.autograph.experimental.do_not_convert
    def _as_dataset(
        self,
        sample_batch_size: int | None = None,
        num_steps: int | None = None,
        sequence_preprocess_fn: Any = None,
        num_parallel_calls: int | None = None,
    ) -> tf.data.Dataset:
        # TF-Agents reads items shaped by `_data_spec`: the stored steps (a packed table's
        # rows) for the time it builds the pipeline; each sequence is unpacked before anything
        # else sees it.
        layout = self._layout
        data_spec = self._data_spec
        if sample_batch_size is not None:  # before TF-Agents builds anything for it
            require_batch_size(
                "sample_batch_size",
                sample_batch_size,
                layout_of(data_spec).step_bytes * (num_steps or self._sequence_length),
                what=f"table {self._table_name!r}",
            )
        sequence_length = self._sequence_length
        if isinstance(layout, FramedLayout):
            if num_steps not in (None, sequence_length):
                raise ConfigError(
                    f"num_steps={num_steps!r}: a frame-stacked table (frame_stack="
                    f"{layout.frame_stack}) is read in whole items of sequence_length "
                    f"{sequence_length} (num_steps=None or {sequence_length})"
                )
            # Its items hold K - 1 steps more, which the unpacking turns into stacks.
            num_steps = None
            self._sequence_length = sequence_length + layout.history
        self._data_spec = layout.step_spec()
        try:
            dataset = super()._as_dataset(
                sample_batch_size,
                num_steps,
                sequence_preprocess(layout, sequence_preprocess_fn),
                num_parallel_calls,
            )
        finally:
            self._data_spec = data_spec
            self._sequence_length = sequence_length
        return bound_sampling(
            dataset,
            self._server_address,
            self._table_name,
            sampling_timeout_message(self._table_name, self._sample_timeout),
            sample_timeout=self._sample_timeout,
            connect_timeout=self._connect_timeout,
            lifeline=self.lifeline,
        )
