"""Frame-stacked observations stored once: each step keeps only its newest frame.

With `frame_stack=K` a step's `observation` is a stack of K frames along `frame_axis` (0:
gymnasium's `FrameStackObservation`, shape `(K, *frame)`; -1: SB3's `VecFrameStack`, channels
last, `(H, W, K*C)`), and each stack is the one before it shifted by one frame. A local table
then stores per step its newest frame and the serial numbers of the steps holding its K-1
earlier frames (`-1`: a zero frame), oldest first, and rebuilds the stacks with one gather per
batch (`FrameStack.assemble`). An episode's first stack is padded: its first frame repeated
(gymnasium's default `padding_type="reset"`: the K-1 earlier frames are the step's own) or
zeros (SB3, `padding_type="zero"`). An all-zero stack (the final observation of an episode
that a vector collector did not see) is stored as zero padding of a zero frame.

`FrameStack` holds the geometry and the checks of what collectors write (`check_step`) and of
whole windows inserted (`check_windows`), both raising `SpecMismatchError` naming the step and
the frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import bytes_equal

if TYPE_CHECKING:  # torch loads with the first stack assembled: a replay-server needs none
    import torch

OBSERVATION = "observation"
AXES = (0, -1)

try:  # numpy's C function: `np.count_nonzero`'s wrapper costs more than counting a frame
    from numpy._core.multiarray import count_nonzero as _count_nonzero
except ImportError:  # pragma: no cover - a numpy without it
    _count_nonzero = np.count_nonzero


def any_bit(array: np.ndarray) -> bool:
    """Whether any bit of `array` (frames or stacks) is set: a float frame of -0.0 or NaN is
    no zero frame (as `bits` compares)."""
    return bool(_count_nonzero(bits(array)))


def bits(array: np.ndarray) -> np.ndarray:
    """`array` as unsigned integers of its itemsize when it holds floats: frames compared and
    found zero bit for bit, so that a NaN equals itself and -0.0 is no zero frame (each is
    stored and read back as it came).

    Args:
      array: Frames or stacks.

    Returns:
      A view of `array` (itself unless it holds floats).
    """
    if array.dtype.kind == "f":
        return array.view(np.dtype(f"u{array.dtype.itemsize}"))
    return array


def check_frame_stack(data_spec: Any, frame_stack: Any, frame_axis: Any) -> None:
    """Refuses a frame stack the data spec's observation cannot be.

    Args:
      data_spec: The per-step `Trajectory` spec.
      frame_stack: Frames per observation (an integer >= 2), or None: no frame stack.
      frame_axis: 0 or -1, the observation's axis the frames are stacked along.

    Raises:
      ConfigError: Naming the value: `frame_stack` not an integer >= 2, `frame_axis` not 0 or
        -1, an observation that is a nest or whose axis length is not a multiple of
        `frame_stack`.
    """
    if frame_stack is None:
        return
    if isinstance(frame_stack, bool) or not isinstance(frame_stack, int | np.integer):
        raise ConfigError(f"frame_stack must be an integer >= 2 or None, got {frame_stack!r}")
    if frame_stack < 2:
        raise ConfigError(f"frame_stack must be an integer >= 2 or None, got {frame_stack!r}")
    if isinstance(frame_axis, bool) or frame_axis not in AXES:
        raise ConfigError(f"frame_axis must be 0 or -1, got {frame_axis!r}")
    observation = getattr(data_spec, OBSERVATION, None)
    shape = getattr(observation, "shape", None)
    if observation is None or shape is None or not hasattr(observation, "dtype"):
        raise ConfigError(
            f"frame_stack={frame_stack!r} needs an observation that is one array spec, got "
            f"{type(observation).__name__}: {observation!r}"
        )
    dims = [int(d) for d in shape]
    if not dims or dims[frame_axis] % frame_stack:
        raise ConfigError(
            f"frame_stack={frame_stack!r}: the observation's shape {dims} has no axis "
            f"frame_axis={frame_axis!r} whose length is a multiple of {frame_stack}"
        )


class FrameStack:
    """The frames of a table's stacked observation field (see the module docstring).

    Args:
      k: Frames per stack.
      axis: 0 or -1.
      field: Index of the observation among the table's fields.
      stacked: The observation's per-step shape.
    """

    def __init__(self, k: int, axis: int, field: int, stacked: tuple[int, ...]) -> None:
        self.k = int(k)
        self.field = field
        self.stacked = tuple(stacked)
        self.axis = axis % len(stacked)
        frame = list(stacked)
        frame[self.axis] //= self.k
        self.frame = tuple(frame)  # one frame, the stacked axis of length C
        self.channels = frame[self.axis]

    @classmethod
    def for_table(cls, k: int | None, axis: int, fields: list[dict[str, Any]]) -> FrameStack | None:
        """The frame stack of a table's `fields` (`describe_spec` of its stored spec); None
        without `k`."""
        if k is None:
            return None
        for index, field in enumerate(fields):
            if field["path"] == OBSERVATION:
                return cls(k, axis, index, tuple(int(d) for d in field["shape"]))
        raise ConfigError(f"frame_stack={k!r} needs an 'observation' field; fields: {fields}")

    # ---------------------------------------------------------------------------- frames

    def frames(self, stacks: np.ndarray) -> np.ndarray:
        """`[n, *stacked]` -> `[n, K, *frame]` (the K frames of each stack, oldest first)."""
        n = stacks.shape[0]
        a = self.axis
        split = stacks.reshape(n, *self.stacked[:a], self.k, self.channels, *self.stacked[a + 1 :])
        return np.moveaxis(split, 1 + a, 1)

    def zero(self, stack: np.ndarray) -> bool:
        """Whether every frame of one stack is zero bit for bit (its newest frame, which
        rarely is, looked at first)."""
        if any_bit(self.part(stack, self.k - 1, self.k)):
            return False
        return not any_bit(stack)

    def part(self, stack: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Frames `[start, stop)` of one stack, a view (along its axis, as stacked)."""
        c = self.channels
        if not self.axis:
            return stack[start * c : stop * c]
        return stack[(slice(None),) * self.axis + (slice(start * c, stop * c),)]

    def newest(self, stacks: np.ndarray) -> np.ndarray:
        """`[n, *stacked]` -> `[n, *frame]`, each stack's newest frame (a copy)."""
        return np.ascontiguousarray(self.frames(stacks)[:, -1])

    def stacks(self, frames: np.ndarray) -> np.ndarray:
        """`[n, K, *frame]` frames -> `[n, *stacked]` stacks (`assemble` in numpy): a view
        where the frames' layout allows it (frames stacked along axis 0), else a copy."""
        if self.axis:
            frames = np.moveaxis(frames, 1, 1 + self.axis)
        return frames.reshape(frames.shape[0], *self.stacked)

    def assemble(self, frames: torch.Tensor) -> torch.Tensor:
        """`[..., K, *frame]` gathered frames -> `[..., *stacked]` stacks."""
        lead = frames.shape[: frames.dim() - 1 - len(self.frame)]
        at = len(lead)
        moved = frames.movedim(at, at + self.axis)
        return moved.reshape(*lead, *self.stacked)

    # ---------------------------------------------------------------------------- checks

    def padding(self, stack: np.ndarray) -> str | None:
        """How an episode's first stack is padded: "reset" (its newest frame repeated),
        "zero" (zeros before it), None: neither."""
        frames = bits(self.frames(stack[None])[0])
        if (frames[:-1] == frames[-1]).all():
            return "reset"
        if not frames[:-1].any():
            return "zero"
        return None

    def check_step(
        self, stack: np.ndarray, previous: np.ndarray | None, step: int, where: str
    ) -> None:
        """Refuses an observation that does not follow `previous` (its first K-1 frames are
        not `previous`'s last K-1), or an episode's first one (`previous` None) that is not
        padded. An all-zero stack is accepted anywhere (an unknown final observation).

        Args:
          stack: The step's observation.
          previous: The episode's previous observation; None at the episode's first step.
          step: The step's index in its episode (named in the error).
          where: What wrote it (named in the error).

        Raises:
          SpecMismatchError: Naming the step and the first frame that differs.
        """
        k = self.k
        # The common case first: the stack follows `previous` (bytes compared, as `bits`;
        # one side copied, the other read in place where it is contiguous).
        if previous is not None and bytes_equal(
            self.part(stack, 0, k - 1), self.part(previous, 1, k).tobytes()
        ):
            return
        if not bits(stack).any():
            return
        if previous is None:
            if self.padding(stack) is None:
                raise SpecMismatchError(
                    f"{where}: step {step} starts an episode but its observation is not a "
                    f"padded stack of {self.k} frames along axis {self.axis} (frames 0..."
                    f"{self.k - 2} must repeat frame {self.k - 1}, padding_type='reset', or "
                    "be zeros, padding_type='zero'); nothing was written"
                )
            return
        stack, previous = bits(stack), bits(previous)
        now = self.frames(stack[None])[0][:-1]
        before = self.frames(previous[None])[0][1:]
        same = (now == before).reshape(self.k - 1, -1).all(axis=1)
        if not same.all():
            frame = int(np.flatnonzero(~same)[0])
            raise SpecMismatchError(
                f"{where}: step {step} of the episode: frame {frame} of its observation (a "
                f"stack of {self.k} along axis {self.axis}) is not frame {frame + 1} of the "
                "previous step's, as a frame stack's must be; nothing was written"
            )

    def check_windows(self, stacks: np.ndarray, table: str) -> None:
        """Refuses windows `[n, length, *stacked]` whose consecutive stacks are not shifted
        by one frame (an insert of whole items: an import, a restore).

        Raises:
          SpecMismatchError: Naming the item, the step and the frame.
        """
        n, length = stacks.shape[:2]
        if length < 2 or n == 0:
            return
        frames = bits(self.frames(stacks.reshape(n * length, *self.stacked)))
        frames = frames.reshape(n, length, self.k, -1)
        now, before = frames[:, 1:, :-1], frames[:, :-1, 1:]
        zero = ~bits(stacks).reshape(n, length, -1).any(axis=2)
        same = (now == before).all(axis=3) | zero[:, 1:, None]  # zeros: an unknown final
        if not same.all():
            item, step, frame = (int(i[0]) for i in np.nonzero(~same))
            raise SpecMismatchError(
                f"table {table!r}: item {item}, step {step + 1}: frame {frame} of its "
                f"observation is not frame {frame + 1} of step {step}'s, as a stack of "
                f"{self.k} frames must be; nothing was inserted"
            )
