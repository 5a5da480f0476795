"""The tf.data steps of each layout: packed rows unpacked inside TensorFlow pipelines.

A nested table's items are the step nest already; a packed table's data is `uint8` rows that
`PackedLayout.unpack_tf` turns back into the nest (a slice, `tf.bitcast` and reshape per field).
`unpack_samples` does it for the batches of this project's pipelines (`pipeline`, `mixing`),
`sequence_preprocess` for TF-Agents' `ReverbReplayBuffer.as_dataset` (`tf_agents_buffer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay_service.specs.layouts import Layout
from replay_service.specs.packed import PackedLayout


def unpack_samples(layout: Layout, dataset: Any) -> Any:
    """A tf.data dataset of `ReplaySample(info, data)` batches with `data` as the nest.

    Args:
      layout: How the table stores steps.
      dataset: Batches whose data is what the table stores.

    Returns:
      `dataset` with the data of every batch unpacked (`PackedLayout.unpack_tf`), or `dataset`
      itself where nothing is packed.
    """
    if not isinstance(layout, PackedLayout):
        return dataset

    def unpack(sample: Any) -> Any:
        return sample._replace(data=layout.unpack_tf(sample.data))

    return dataset.map(unpack)


def sequence_preprocess(
    layout: Layout, fn: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """TF-Agents' `sequence_preprocess_fn` for items read as `layout.step_spec()` steps.

    Args:
      layout: How the table stores steps.
      fn: The caller's `sequence_preprocess_fn`, or None.

    Returns:
      A function that unpacks each sequence (`PackedLayout.unpack_tf`) before `fn` sees it, or
      `fn` itself where nothing is packed.
    """
    if not isinstance(layout, PackedLayout):
        return fn
    import tensorflow as tf

    @tf.autograph.experimental.do_not_convert
    def unpack_then(data: Any) -> Any:
        data = layout.unpack_tf(data)
        return data if fn is None else fn(data)

    return unpack_then
