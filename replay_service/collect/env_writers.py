"""The writers of a `TransitionWriter`: one `WindowWriter` per environment.

Each environment's episodes go to a writer of their own, opened from the client on the env's
first step (`WriteTarget.open_writer`). Every `flush_every` steps a writer waits until at most
`FLUSH_DOWN_TO` of its items are unconfirmed; at an episode's end a padded table's windows are
completed with padding steps, and the episode ends without waiting where the writer can
(`WindowWriter.next_episode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_service.collect.observer import FLUSH_DOWN_TO, WriteTarget
from replay_service.collect.writing import WindowWriter


class EnvWriters:
    """The writers of the environments of one `TransitionWriter`.

    Args:
      target: What they write to.
      padding: A padded table's padding step (flat leaves, the mask False last); None for a
        table that is not padded.

    Attributes:
      writers: Per env, its writer (None until its first step).
      steps: Per env, the steps of its current episode written so far.
    """

    def __init__(self, target: WriteTarget, padding: list[Any] | None) -> None:
        self._target = target
        self._flush_every = target.flush_every  # read on every step
        self._padding = padding
        # A padded table stores Masked(step, mask): each real step ends with mask True.
        self._mask: list[Any] = [np.True_] if padding is not None else []
        self.writers: list[WindowWriter | None] = []
        self.steps: list[int] = []
        self._since_flush: list[int] = []

    def start(self, num_envs: int) -> None:
        """Makes room for `num_envs` environments (before their first step)."""
        self.writers = [None] * num_envs
        self.steps = [0] * num_envs
        self._since_flush = [0] * num_envs

    def append(self, index: int, step: Sequence[Any]) -> None:
        """Appends one step of env `index` (its flat leaves), waiting for the server every
        `flush_every` steps.

        Raises:
          WriteTimeoutError: If the server does not confirm items within the write timeout.
        """
        if self._mask:  # a padded table: the step is real, Masked(step, mask=True)
            step = [*step, *self._mask]
        self._append_raw(index, step)

    def _append_raw(self, index: int, step: Sequence[Any]) -> None:
        writer = self.writers[index]
        if writer is None:
            writer = self._target.open_writer()
            self.writers[index] = writer
        writer.append(step)
        self.steps[index] += 1
        since_flush = self._since_flush[index] + 1
        if since_flush >= self._flush_every:
            self._target.wait(
                lambda: writer.flush(FLUSH_DOWN_TO, timeout_ms=self._target.timeout_ms)
            )
            since_flush = 0
        self._since_flush[index] = since_flush

    def end_episode(self, index: int, *, confirm: bool = True) -> None:
        """Ends env `index`'s episode (padding it first where the table pads).

        Args:
          index: The env.
          confirm: Wait until the writer's items are confirmed (reset, close). False, at an
            episode boundary inside a stream of steps: a writer that can end an episode
            without waiting (`WindowWriter.next_episode`) does, and its items stay
            counted for the periodic wait, which bounds them as within an episode.

        Raises:
          WriteTimeoutError: If the server does not confirm items within the write timeout.
        """
        writer = self.writers[index]
        if self._padding is not None and writer is not None:
            steps = int(self.steps[index])
            for _ in range(self._target.padding(steps)):
                self._append_raw(index, self._padding)
        self.steps[index] = 0
        if writer is None:
            self._since_flush[index] = 0
            return
        if not confirm and writer.next_episode():
            return
        self._since_flush[index] = 0
        target = self._target
        target.wait(lambda: writer.end_episode(clear_buffers=True, timeout_ms=target.timeout_ms))

    def flush(self, timeout_ms: int | None = None) -> None:
        """Blocks until every item written so far is confirmed by the server.

        Args:
          timeout_ms: Bound on each writer's wait in milliseconds; None: the write timeout.

        Raises:
          WriteTimeoutError: If that takes longer than the bound.
        """
        wait_ms = self._target.timeout_ms if timeout_ms is None else timeout_ms
        for index, writer in enumerate(self.writers):
            if writer is not None:
                self._target.wait(lambda w=writer: w.flush(timeout_ms=wait_ms), wait_ms)
                self._since_flush[index] = 0

    def close(self) -> None:
        """Ends every env's episode, waiting for its items, and drops the writers; a writer
        whose wait fails is abandoned (`WindowWriter.abandon`).

        Raises:
          Exception: The first error of an episode's end, once every episode was ended.
        """
        error: Exception | None = None
        for index in range(len(self.writers)):
            try:
                self.end_episode(index)
            except Exception as e:  # end the other episodes before reporting it
                writer = self.writers[index]
                if writer is not None:
                    writer.abandon()
                error = error or e
        self.writers = []
        if error is not None:
            raise error
