"""A transition writer's frame-stacked steps: their stacks checked before a call appends any,
and a step within an episode written straight to its env's writer.

`TransitionWriter.add` of a frame-stacked step within an episode that does not end it, once
the env's writer takes such steps (`stacked_path`), skips the general fast path: the state is
compared in place with the previous next state's copy, which the step holds as it is (a
read-only array over one of a ring of preallocated buffers the next states are copied into),
a Discrete action is converted once per value and kept read-only, and a float reward is
converted with the type bound once (`StackedSteps._add_stacked`). The stacks a writer would
refuse after other steps of the same call were appended (an episode's first stack, an ended
episode's final one) are checked before any is (`StackedSteps._check_stacks`), so a refused call
writes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_service.collect.env_writers import EnvWriters
from replay_service.collect.observer import WriteTarget
from replay_service.collect.transition_steps import FlatSteps
from replay_service.specs.frames import FrameStack


class StackedSteps:
    """The frame-stacked steps of a `TransitionWriter`, a base class of it (see the module
    docstring)."""

    # What the transition writer provides.
    _plan: FlatSteps
    _envs: EnvWriters
    _target: WriteTarget
    _frames: FrameStack | None
    _frames_where: str
    _expected: list[bytes | bytearray]
    _has_expected: list[bool]

    def _init_stacked(self, frame_stack: int | None, frame_axis: int, bindable: bool) -> None:
        """Sets the stacked path's state, unbound (`__init__`'s part of it).

        Args:
          frame_stack: Frames per stacked observation; None: not stacked.
          frame_axis: The axis the frames are stacked along.
          bindable: The writer's other options allow the path: continuity checked, no
            end-of-episode padding, no extra tables.
        """
        # A stacked observation's shape and dtype (`_add_fast`); None: not stacked.
        self._stack: tuple[tuple[int, ...], np.dtype] | None = None
        if frame_stack is not None:
            leaf = self._plan.observation.leaves[0]
            self._stack = (leaf.shape, leaf.dtype)
        # `add`'s path for a frame-stacked step within an episode, straight to a writer that
        # takes such steps (`_bind_stacked`): None until bound, False where it cannot be.
        self._stacked: Any = None
        self._stacked_possible = (
            frame_stack is not None
            and frame_axis == 0
            and bindable
            and not self._plan.hidden.leaves
            and len(self._plan.observation.leaves) == 1
            and len(self._plan.action.leaves) == 1
            and len(self._plan.reward.leaves) == 1
            and self._plan.reward.leaves[0].finite_scalar
        )
        # A stacked path's copies of the next states (`_bind_stacked`): a ring of preallocated
        # buffers, their writable arrays and read-only ones, and the one last filled.
        self._pool: list[bytearray] = []
        self._pool_arrays: list[np.ndarray] = []
        self._pool_kept: list[np.ndarray] = []
        self._turn = -1
        # The read-only array over the buffer `_expected` holds (None: `_expected` is other).
        self._expected_kept: np.ndarray | None = None
        self._reward_type = self._plan.reward.leaves[0].scalar_type
        # Discrete actions as the read-only arrays the fast path converts them to, by value.
        self._action_arrays: dict[int, np.ndarray] = {}

    def _add_stacked(
        self,
        state: Any,
        action: Any,
        reward: Any,
        next_state: Any,
        done: Any,
        truncated: Any,
    ) -> bool:
        """`_add_fast` of a frame-stacked step within an episode that does not end it, straight
        to the env's writer (`_bind_stacked`): the state compared in place with the previous
        next state's copy, which the step holds as it is (a read-only array of the copies'
        ring), the next state copied into the ring's next buffer, a Discrete action and a
        float reward converted once.

        Returns:
          False, having written nothing, where any value or the episode's state needs
          `_add_fast` (which then converts, refuses or writes it); True once it is written.
        """
        if (
            not (done is False or done is np.False_)
            or not (truncated is False or truncated is np.False_)
            or not self._has_expected[0]
        ):
            return False
        kept = self._expected_kept
        shape, dtype = self._stack  # type: ignore[misc]
        if (
            kept is None
            or type(state) is not np.ndarray
            or type(next_state) is not np.ndarray
            or state.shape != shape
            or next_state.shape != shape
            or (state.dtype is not dtype and state.dtype != dtype)
            or (next_state.dtype is not dtype and next_state.dtype != dtype)
            or not state.flags.c_contiguous
            or not self._expected[0].startswith(state)  # the previous next state's bytes
        ):
            return False
        if type(action) is int:
            array = self._action_arrays.get(action)
            if array is None:
                array = self._action_array(action)
                if array is None:
                    return False
        else:
            converted = self._plan.action.convert(action)
            if converted is None:
                return False
            array = converted[0]
            if type(array) is np.ndarray:
                array = array.copy()  # the caller may refill its array
        reward_type = self._reward_type
        if type(reward) is not float and type(reward) is not reward_type:
            return False
        value = reward_type(reward)
        if not math.isfinite(value):
            return False
        plan = self._plan
        expected = self._expected
        self._stacked([plan.mid, kept, array, plan.next_mid, value, plan.continuing], expected[0])
        self._envs.steps[0] += 1  # its writer never waits (`stacked_path`): no flush counted
        # `_keep_next`, inline.
        turn = self._turn = (self._turn + 1) % len(self._pool)
        np.copyto(self._pool_arrays[turn], next_state)
        expected[0] = self._pool[turn]
        self._expected_kept = self._pool_kept[turn]
        return True

    def _action_array(self, action: int) -> np.ndarray | None:
        """A Discrete action as `Leaf.convert` makes it, read-only and kept for its next use;
        None where the action takes the full validation (out of the dtype's range)."""
        leaf = self._plan.action.leaves[0]
        if leaf.dtype.kind not in "iu" or leaf.shape not in ((), (1,)):
            return None
        info = np.iinfo(leaf.dtype)
        if not info.min <= action <= info.max:
            return None
        array = np.full(leaf.shape, action, leaf.dtype)
        array.flags.writeable = False
        if len(self._action_arrays) < 4096:
            self._action_arrays[action] = array
        return array

    def _keep_next(self, next_state: np.ndarray) -> None:
        """Copies a next state into the next buffer of the copies' ring (the one no kept step
        holds), as the state the next call must continue."""
        turn = self._turn = (self._turn + 1) % len(self._pool)
        np.copyto(self._pool_arrays[turn], next_state)
        self._expected = [self._pool[turn]]
        self._expected_kept = self._pool_kept[turn]

    def _bind_stacked(self) -> None:
        """Binds `add`'s stacked path once the env's writer is open: where it takes a
        transition writer's steps within an episode straight (`stacked_path`), the next
        states are then copied into a ring of `sequence_length + 2` preallocated buffers, so
        that the steps its history keeps (the last `sequence_length`) and the expected state
        are never the buffer filled next."""
        writer = self._envs.writers[0] if self._envs.writers else None
        path = getattr(writer, "stacked_path", None)
        bound = path() if path is not None else None
        if bound is None:
            self._stacked = False
            return
        shape, dtype = self._stack  # type: ignore[misc]
        count = self._target.sequence_length + 2
        self._pool = [bytearray(math.prod(shape) * dtype.itemsize) for _ in range(count)]
        self._pool_arrays = [np.frombuffer(raw, dtype).reshape(shape) for raw in self._pool]
        self._pool_kept = []
        for array in self._pool_arrays:
            kept = array.view()
            kept.flags.writeable = False
            self._pool_kept.append(kept)
        self._turn = -1
        self._stacked = bound

    def _check_stacks(self, states: Any, finals: Any, ended: Sequence[bool]) -> None:
        """Checks, before anything of the call is appended, the stacks a frame-stacked table's
        writer would refuse after earlier appends of the call: each env's episode-first
        stack (`states[i]` where the env's episode has no step yet) and each ended episode's
        final stack (`finals[i]`, None: unknown, all zeros) against its last state.

        Raises:
          SpecMismatchError: As the writer would (`FrameStack.check_step`), naming the step.
        """
        frames = self._frames
        assert frames is not None
        for index, steps in enumerate(self._envs.steps):
            state = np.asarray(states[index])
            if not steps:
                frames.check_step(state, None, 0, self._frames_where)
            if ended[index] and finals is not None:
                frames.check_step(np.asarray(finals[index]), state, steps + 1, self._frames_where)
