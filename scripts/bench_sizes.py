"""Small steps at every size: sampling CartPole transitions from FULL buffers of 10k to 1M.

`scripts/benchmark.py --workloads=sizes` calls `sizes_rows`. At each size, ours
(`ReplayBufferManager.from_spaces(...)`, the local backend, `torch_batches(256,
transitions=True)`) and cpprb's `ReplayBuffer.sample(256)` (each field wrapped in
`torch.from_numpy`, as users do, and bare) sample from buffers holding `size` transitions, in
this process, taking turns in rounds so that a change in the machine's load falls on all alike;
each rate is that of the sampler's median round.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 256
EPISODE = 200
NUM_ENVS = 100  # the fill writes `add_multi` rows of this many envs
# Rounds of `batches // ROUNDS` batches per sampler, taking turns; a rate is that of the
# median round. A round lasts milliseconds: on a machine whose cores other processes share, one
# preemption (several milliseconds) stretches the round it falls in, which a sum of all rounds
# would charge to whichever sampler it hit.
ROUNDS = 20
OURS = "ours torch_batches transitions"
CPPRB_TORCH = "cpprb sample + torch.from_numpy"
CPPRB = "cpprb sample (numpy)"


def size_label(size: int) -> str:
    """10000 -> "10k", 1000000 -> "1M"."""
    if size % 1_000_000 == 0:
        return f"{size // 1_000_000}M"
    return f"{size // 1000}k" if size % 1000 == 0 else str(size)


def cartpole_spaces() -> tuple[Any, Any]:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    return spaces


def fill_ours(manager: Any, size: int, rng: np.random.Generator) -> None:
    """Writes CartPole-shaped transitions from `NUM_ENVS` auto-resetting envs (episodes of
    `EPISODE` steps) until the table holds `size` items."""
    envs = min(NUM_ENVS, size)
    writer = manager.transition_writer()
    states = rng.standard_normal((envs, 4)).astype(np.float32)
    actions = np.zeros(envs, np.int64)
    rewards = np.ones(envs, np.float32)
    t = 0
    while True:
        for _ in range(max(1, size // envs // 4)):
            nexts = rng.standard_normal((envs, 4)).astype(np.float32)
            done = t % EPISODE == EPISODE - 1
            dones = np.full(envs, done)
            if done:  # auto-reset: next_states is the new episode's first observation
                finals = nexts
                nexts = rng.standard_normal((envs, 4)).astype(np.float32)
                writer.add_multi(states, actions, rewards, nexts, dones, final_states=finals)
            else:
                writer.add_multi(states, actions, rewards, nexts, dones)
            states, t = nexts, t + 1
        writer.flush()
        if manager.num_frames() >= size:
            break
    writer.close()


def cpprb_buffer(size: int, rng: np.random.Generator) -> Any:
    """cpprb's `ReplayBuffer(size)` holding `size` CartPole-shaped transitions."""
    import cpprb

    buffer = cpprb.ReplayBuffer(
        size,
        {
            "obs": {"shape": 4, "dtype": np.float32},
            "act": {"shape": 1, "dtype": np.int64},
            "rew": {},
            "next_obs": {"shape": 4, "dtype": np.float32},
            "done": {},
        },
    )
    obs = rng.standard_normal((size + 1, 4)).astype(np.float32)
    buffer.add(
        obs=obs[:-1],
        act=np.zeros((size, 1), np.int64),
        rew=np.ones(size, np.float32),
        next_obs=obs[1:],
        done=(np.arange(size) % EPISODE == EPISODE - 1).astype(np.float32),
    )
    assert buffer.get_stored_size() == size
    return buffer


def sizes_rates(sizes: list[int], batches: int, seed: int = 0) -> dict[int, dict[str, float]]:
    """Items/s of ours and cpprb's (wrapped and bare) at each size.

    Args:
      sizes: Transitions each full buffer holds.
      batches: Batches of `BATCH` timed per sampler and size (in `ROUNDS` rounds; the rate is
        the median round's).
      seed: Seeds the data.

    Returns:
      size -> {OURS, CPPRB_TORCH, CPPRB: items/s}.
    """
    import torch

    from replay_service import ReplayBufferManager

    rng = np.random.default_rng(seed)
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        root = tempfile.mkdtemp(prefix="replay_bench_sizes_")
        manager = ReplayBufferManager.from_spaces(
            *cartpole_spaces(), capacity=size, checkpoint_dir=os.path.join(root, "replay")
        )
        manager.create_replay_buffer()
        fill_ours(manager, size, rng)
        buffer = cpprb_buffer(size, rng)
        stream = manager.torch_batches(BATCH, transitions=True)
        ours = iter(stream)

        def wrapped(buffer: Any = buffer) -> Iterator[Any]:
            while True:
                yield {k: torch.from_numpy(v) for k, v in buffer.sample(BATCH).items()}

        def bare(buffer: Any = buffer) -> Iterator[Any]:
            while True:
                yield buffer.sample(BATCH)

        samplers = {OURS: ours, CPPRB_TORCH: wrapped(), CPPRB: bare()}
        seconds: dict[str, list[float]] = {name: [] for name in samplers}
        per_round = max(1, batches // ROUNDS)
        for it in samplers.values():  # warm-up
            for _ in range(5):
                next(it)
        for _ in range(ROUNDS):
            for name, it in samplers.items():
                start = time.perf_counter()
                for _ in range(per_round):
                    next(it)
                seconds[name].append(time.perf_counter() - start)
        stream.close()
        manager.close()
        shutil.rmtree(root, ignore_errors=True)
        items = per_round * BATCH
        results[size] = {name: items / float(np.median(s)) for name, s in seconds.items()}
    return results


def sizes_rows(sizes: list[int], batches: int) -> list[tuple[str, str, str, float, str, Any]]:
    """Rows (workload, metric, path, value, unit, anchor path or None) for `benchmark.Row`."""
    rows: list[tuple[str, str, str, float, str, Any]] = []
    for size, rates in sizes_rates(sizes, batches).items():
        tag = f" {size_label(size)}"
        rows += [
            ("sizes", "sample", CPPRB + tag, rates[CPPRB], "it/s", None),
            ("sizes", "sample", CPPRB_TORCH + tag, rates[CPPRB_TORCH], "it/s", None),
            ("sizes", "sample", OURS + tag, rates[OURS], "it/s", CPPRB_TORCH + tag),
            ("sizes", "sample", "  same, vs cpprb numpy" + tag, rates[OURS], "it/s", CPPRB + tag),
        ]
    return rows
