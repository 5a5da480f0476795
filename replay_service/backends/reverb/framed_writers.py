"""The Reverb writer of frame-stacked tables: one frame per step, items spanning earlier steps.

`FramedWindowWriter` is the collectors' writer of a `specs.framed.FramedLayout` table (a
Reverb buffer with `frame_stack=K`). Each step is checked against the episode's previous one
(`FrameStack.check_step`: a stack that is not the previous one shifted by one frame, or an
episode's first one that is not padded, is a `SpecMismatchError` naming the step, and nothing
of it is written), then appended as one packed row holding its newest frame and its mark
(`FramedLayout.encode_row`). Its windows are those of `packed_writers.PackedWindowWriter` (the last
`sequence_length` steps every `stride_length` steps, counted from each episode's first step),
each item referencing the K-1 steps before its first one too, so that the reader rebuilds
every stack. Those steps are kept from one episode to the next (a mark hides them); a writer's first
episode starts after K-1 zero rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tree

from replay_service.backends.reverb.packed_writers import SentWriter
from replay_service.errors import SpecMismatchError
from replay_service.specs.framed import ZERO, FramedLayout


class FramedWindowWriter(SentWriter):
    """Writes framed rows and inserts the windows of `PackedWindowWriter` (same API), each
    item `K - 1 + sequence_length` rows long (see the module docstring).

    Args:
      client: A plain `reverb.Client`.
      windows: Per table `(name, sequence_length, stride_length, priority, padded)`; padded
        tables are refused where the frame stack is configured.
      layout: The tables' `FramedLayout`.
    """

    def __init__(
        self,
        client: Any,
        windows: Sequence[tuple[str, int, int, float, bool]],
        layout: FramedLayout,
    ) -> None:
        from reverb import pybind

        self._layout = layout
        self._frames = layout.frames
        self._leaves = len(layout.stacks.fields)
        self._windows = [
            (name, int(length), int(stride), float(priority), int(length) - 1)
            for name, length, stride, priority, _ in windows
        ]
        self._span = max(w[1] for w in self._windows) + layout.history
        keep, chunk = layout.writer_chunking(max(w[1] for w in self._windows))
        self._start_sending(client.trajectory_writer(num_keep_alive_refs=keep))
        self._cpp.ConfigureChunker(
            0, pybind.ConstantChunkerOptions(max_chunk_length=chunk, num_keep_alive_refs=keep)
        )
        self._filler = np.zeros(layout.step_bytes, np.uint8)
        self._filler[-1] = ZERO
        self._refs: list[Any] = []
        self._step = 0
        self._previous: np.ndarray | None = None
        self._since = [0] * len(self._windows)
        self._where = f"table {self._windows[0][0]!r} (frame_stack={layout.frame_stack})"

    def append(self, step: Any) -> None:
        """Checks and appends one step (a nest shaped like the data spec, or its flat leaves
        as a list) and inserts every window it completes.

        Raises:
          SpecMismatchError: If its observation does not follow the episode's previous one
            (naming the step and the frame); nothing is written.
          ValueError: If the step does not match the stored spec.
        """
        leaves = step if type(step) is list else tree.flatten(step)
        if len(leaves) != self._leaves:
            raise ValueError(f"a step of this table has {self._leaves} fields, got {len(leaves)}")
        frames = self._frames
        stack = np.asarray(leaves[frames.field])
        if stack.shape != frames.stacked:
            raise SpecMismatchError(
                f"{self._where}: step {self._step} of the episode: observation of shape "
                f"{list(stack.shape)}, expected {list(frames.stacked)}"
            )
        frames.check_step(stack, self._previous, self._step, self._where)
        row = self._layout.encode_row(leaves, self._layout.mark(stack, self._step == 0))
        refs = self._refs
        if len(refs) < self._layout.history:
            # A writer's first episode: rows before it for its first items to reference.
            for _ in range(self._layout.history - len(refs)):
                refs.append(self._cpp.Append([self._filler])[0])
        refs.append(self._cpp.Append([row])[0])
        if len(refs) > self._span:
            del refs[0]
        # A copy: the caller may fill the same array in place for its next step.
        self._previous = stack.copy()
        index = self._step
        self._step = index + 1
        since = self._since
        history = self._layout.history
        for k, (name, length, stride, priority, first) in enumerate(self._windows):
            count = since[k] + 1
            if index >= first and count >= stride:
                self._cpp.CreateItem(name, priority, [refs[-(length + history) :]], [False])
                count = 0
            since[k] = count
        self._unsent = True

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Ends the episode, waiting as Reverb's `end_episode` until every item written so far
        is confirmed; the next episode starts after zero rows again (Reverb let go of the
        earlier steps).

        Raises:
          DeadlineExceededError: If that takes longer than `timeout_ms`.
        """
        self._writer.end_episode(clear_buffers, timeout_ms=timeout_ms)
        self.next_episode()
        self._refs = []

    def next_episode(self) -> bool:
        """Ends the episode without waiting: the next step starts a new one (its stack must be
        padded), and items of the new episode reference this one's last steps only as
        history hidden by its first step's mark.

        Returns:
          True: the episode ended (see `collect.writing.WindowWriter.next_episode`).
        """
        self._step = 0
        self._previous = None
        # The stride is counted from the episode's first step (as the local writers and
        # TF-Agents count it): an episode's first item is at its step `sequence_length - 1`.
        self._since = [0] * len(self._windows)
        return True
