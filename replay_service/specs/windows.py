"""Fixed-length sequences and whole episodes, padded at the end of an episode, with a mask.

Items of a table are windows of `sequence_length` consecutive steps of one episode, one every
`stride_length` steps; no item ever spans two episodes (the writers end Reverb's episode at
every episode boundary). Without padding, a window is written only once `sequence_length` steps
of the episode exist, so an episode shorter than that gives no item and the steps after the last
full window are in no item.

With `pad_end_of_episode=True`, windows start at steps `0, stride, 2 * stride, ...` of each
episode, and when the episode ends, the writer appends zero "padding" steps until the window
that reaches the episode's last step is complete. Every stored step is then a
`Masked(step, mask)`: `mask` is True for the episode's own steps and False for padding, so a
sampled batch is `Masked(step=[B, T, ...], mask=[B, T])` and a recurrent learner multiplies its
per-step losses by the mask. Padding is only ever at the end of an item.

Two common shapes:

- R2D2-style overlapping sequences: `sequence_length=80, stride_length=40`.
- Whole episodes, one item each: `sequence_length = stride_length =` the environment's step
  limit (+1 for TF-Agents' boundary step). A longer episode is stored as consecutive items of
  `sequence_length` steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tree

from replay_service.specs.arrays import ArraySpec
from replay_service.specs.nests import normalize_spec, numpy_dtype

MASK_DTYPE = np.dtype(bool)
"""The dtype of `Masked.mask`."""


class Masked(NamedTuple):
    """One stored step of a padded table.

    Attributes:
      step: The step (a nest shaped like the data spec); zeros for padding.
      mask: True for a real step, False for padding.
    """

    step: Any
    mask: Any


def stored_spec(data_spec: Any, pad_end_of_episode: bool) -> Any:
    """The per-step spec a table stores: `data_spec`, or `Masked(data_spec, bool)` if padded.

    Args:
      data_spec: The per-step data spec (TF specs or `ArraySpec`).
      pad_end_of_episode: Whether the table pads episodes (see module docstring).

    Returns:
      `data_spec` as given, or `Masked(step=normalize_spec(data_spec), mask=bool[])` with a
      `tf.TensorSpec` mask for TF specs and an `ArraySpec` one for `ArraySpec` specs.

    Raises:
      SpecMismatchError: If a padded table's spec is empty or holds something else than specs.
    """
    if not pad_end_of_episode:
        return data_spec
    step = normalize_spec(data_spec)
    if isinstance(tree.flatten(step)[0], ArraySpec):
        return Masked(step=step, mask=ArraySpec((), MASK_DTYPE, "mask"))
    import tensorflow as tf

    return Masked(step=step, mask=tf.TensorSpec([], tf.as_dtype(MASK_DTYPE), "mask"))


def padding_step(data_spec: Any) -> Masked:
    """A padding step: zeros in every field of `data_spec`, mask False.

    Args:
      data_spec: The per-step data spec (TF specs or `ArraySpec`).

    Returns:
      `Masked(step=zeros shaped like data_spec, mask=False)`.
    """
    zeros = tree.map_structure(
        lambda s: np.zeros(s.shape, numpy_dtype(s)), normalize_spec(data_spec)
    )
    return Masked(step=zeros, mask=np.False_)


def padding_needed(num_steps: int, sequence_length: int, stride_length: int) -> int:
    """Padding steps to append to an episode of `num_steps` steps (see module docstring).

    The last window is the first one, among those starting at a multiple of `stride_length`,
    that reaches the episode's last step; padding completes it. When that window would start
    after the last step (a stride longer than the sequence leaves gaps), nothing is padded.

    Args:
      num_steps: Steps written in the episode so far.
      sequence_length: Steps per item.
      stride_length: Steps between the starts of consecutive items.

    Returns:
      The number of padding steps (0 if the episode needs none or is empty).
    """
    if num_steps <= 0:
        return 0
    last = max(0, -(-(num_steps - sequence_length) // stride_length)) * stride_length
    if last > num_steps - 1:
        return 0
    return max(0, last + sequence_length - num_steps)
