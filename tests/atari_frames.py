"""Real Atari frame stacks for the frame-stack tests of both backends: gymnasium's
`FrameStackObservation` over `AtariPreprocessing` on ALE's Breakout, seeded.

A plain module (not a conftest, whose name would shadow tests/conftest.py for the tests that
import from it): each test module makes its `episodes` fixture of `recordings()`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

STEPS = 160  # a few episodes: every lost life terminates one


def breakout(padding: str) -> Any:
    """Breakout as DQN sees it: gymnasium's preprocessing and frame stack of 4."""
    gym = pytest.importorskip("gymnasium")
    ale_py = pytest.importorskip("ale_py")
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = AtariPreprocessing(
        gym.make("BreakoutNoFrameskip-v4", max_episode_steps=120),
        frame_skip=4,
        noop_max=0,
        terminal_on_life_loss=True,
    )
    return FrameStackObservation(env, 4, padding_type=padding)


def record(padding: str, steps: int = STEPS) -> list[tuple[Any, ...]]:
    """`steps` transitions `(state, action, reward, next_state, terminated, truncated)` of a
    seeded random policy."""
    env = breakout(padding)
    rng = np.random.default_rng(0)
    state, _ = env.reset(seed=0)
    out = []
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        next_state, reward, terminated, truncated, _ = env.step(action)
        out.append((state, action, float(reward), next_state, terminated, truncated))
        state = next_state
        if terminated or truncated:
            state, _ = env.reset()
    env.close()
    return out


def recordings() -> dict[str, list[tuple[Any, ...]]]:
    """Recorded transitions per padding ("reset": gymnasium's default, "zero": SB3's)."""
    return {padding: record(padding) for padding in ("reset", "zero")}


def channels_last(transitions: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """SB3's `VecFrameStack` layout `(84, 84, 4)`: the frames along the last axis."""
    return [
        (np.moveaxis(s, 0, -1).copy(), a, r, np.moveaxis(n, 0, -1).copy(), d, t)
        for s, a, r, n, d, t in transitions
    ]


def pairs(transitions: list[tuple[Any, ...]]) -> set[tuple[bytes, bytes]]:
    """The transitions' `(state, next state)` stacks; the last one's item is not written
    unless it ended its episode (its item comes with the next step)."""
    if not (transitions[-1][4] or transitions[-1][5]):
        transitions = transitions[:-1]
    return {(s.tobytes(), n.tobytes()) for s, _, _, n, _, _ in transitions}


def breakout_manager(
    make_from_spaces: Callable[..., Any],
    backend: str,
    name: str = "ckpt",
    axis: int = 0,
    **options: Any,
) -> Any:
    """A frame-stacked manager of Breakout's spaces (stacks of 4 along `axis`, 4 actions,
    capacity 1000) made by the `make_from_spaces` fixture's factory on `backend`."""
    from gymnasium import spaces

    shape = (4, 84, 84) if axis == 0 else (84, 84, 4)
    options.setdefault("capacity", 1000)
    options.setdefault("frame_stack", 4)
    options.setdefault("frame_axis", axis)
    return make_from_spaces(
        backend,
        name,
        spaces.Box(0, 255, shape, np.uint8),
        spaces.Discrete(4),
        **options,
    )


def write(manager: Any, transitions: list[tuple[Any, ...]]) -> None:
    """Adds `transitions` through the manager's transition writer, then closes it."""
    with manager.transition_writer() as writer:
        for transition in transitions:
            writer.add(*transition)


def items(manager: Any) -> list[np.ndarray]:
    """Every item of the manager's table, in order, one array per field."""
    return manager._backend.read_items(manager.table_config).data


def check_items(manager: Any, transitions: list[tuple[Any, ...]]) -> None:
    """Every item, in order, is one transition: its state and next state the env's (the
    last transition's item comes with the step after it, unless it ended its episode)."""
    observations = items(manager)[1]
    assert len(transitions) - 1 <= len(observations) <= len(transitions)
    for (state, *_, next_state, _, _), item in zip(transitions, observations, strict=False):
        np.testing.assert_array_equal(item[0], state)
        np.testing.assert_array_equal(item[1], next_state)


def fill(manager: Any, transitions: list[tuple[Any, ...]], *, check: bool = True) -> set[Any]:
    """Creates the manager's buffer and writes `transitions` (`write`), then checks its items
    (`check_items`, with `check`).

    Returns:
      The transitions' `pairs`, what every read may give.
    """
    manager.create_replay_buffer()
    write(manager, transitions)
    if check:
        check_items(manager, transitions)
    return pairs(transitions)


def laid_out(transitions: list[tuple[Any, ...]], axis: int) -> list[tuple[Any, ...]]:
    """`transitions` with their stacks along `axis` (0 as recorded, -1 `channels_last`),
    checked to hold at least two terminations and one truncation."""
    assert sum(t[4] for t in transitions) >= 2 and sum(t[5] for t in transitions) >= 1
    return transitions if axis == 0 else channels_last(transitions)


def scripted(lengths: list[int], padding: str, shape: tuple[int, ...] = (8, 8)) -> list[Any]:
    """Transitions of episodes of exactly `lengths` steps (the last one terminates each), as
    gymnasium's `FrameStackObservation` (4 frames, `padding`) stacks the random non-zero
    frames of a small env: episodes of any length, faster than Atari's."""
    gym = pytest.importorskip("gymnasium")
    from gymnasium import spaces
    from gymnasium.wrappers import FrameStackObservation

    class Scripted(gym.Env):
        observation_space = spaces.Box(0, 255, shape, np.uint8)
        action_space = spaces.Discrete(4)

        def __init__(self) -> None:
            self.rng = np.random.default_rng(0)
            self.left = list(lengths)
            self.t = 0

        def frame(self) -> np.ndarray:
            return self.rng.integers(1, 256, shape, np.uint8)

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self.t = 0
            return self.frame(), {}

        def step(self, action: Any) -> Any:
            self.t += 1
            return self.frame(), 1.0, self.t == self.left[0], False, {}

    env = FrameStackObservation(Scripted(), 4, padding_type=padding)
    out = []
    state, _ = env.reset(seed=0)
    while env.unwrapped.left:
        action = int(env.unwrapped.t % 4)
        next_state, reward, terminated, truncated, _ = env.step(action)
        out.append((state, action, float(reward), next_state, terminated, truncated))
        state = next_state
        if terminated:
            env.unwrapped.left.pop(0)
            state, _ = env.reset()
    return out


def strided(
    transitions: list[tuple[Any, ...]], sequence_length: int, stride: int
) -> list[tuple[bytes, ...]]:
    """The observation stacks of the items a writer at `stride` makes of `transitions` (one
    episode after another), as bytes: the last `sequence_length` steps at each step index of
    an episode from `sequence_length - 1` on where `stride` steps passed since its previous
    item or, for its first, since the episode started."""
    out: list[tuple[bytes, ...]] = []
    steps: list[bytes] = []
    for state, _, _, next_state, done, cut in transitions:
        steps.append(state.tobytes())
        if done or cut:
            steps.append(next_state.tobytes())
            first = max(sequence_length, stride) - 1
            for index in range(first, len(steps), stride):
                out.append(tuple(steps[index - sequence_length + 1 : index + 1]))
            steps = []
    return out


def interleave(manager: Any, lengths: list[int]) -> set[tuple[bytes, bytes]]:
    """Creates the manager's buffer and writes episodes of `lengths` steps ("reset" padding)
    and of the same lengths reversed ("zero" padding, `scripted`) through two writers whose
    steps alternate.

    Returns:
      The transitions' `pairs`, every `(state, next state)` of the items written.
    """
    first, second = scripted(lengths, "reset"), scripted(lengths[::-1], "zero")
    manager.create_replay_buffer()
    writers = [manager.transition_writer(), manager.transition_writer()]
    for both in itertools.zip_longest(first, second):
        for writer, transition in zip(writers, both, strict=True):
            if transition is not None:
                writer.add(*transition)
    for writer in writers:
        writer.close()
    return pairs(first) | pairs(second)


def stored(manager: Any) -> tuple[int, int]:
    """Steps written into the ring of the manager's local table, and the bytes it holds."""
    ring = manager._backend.client.table(manager.table_name)
    return ring._written, ring.nbytes


def reads(manager: Any) -> tuple[list[np.ndarray], set[tuple[bytes, bytes]]]:
    """Every item of the manager's table in order, and the `(state, next state)` stacks of an
    epoch of its transitions."""
    epoch = {
        (s.numpy().tobytes(), n.numpy().tobytes())
        for batch in manager.epoch_batches(16, seed=0, transitions=True)
        for s, n in zip(batch.states, batch.next_states, strict=True)
    }
    return items(manager), epoch
