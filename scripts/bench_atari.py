"""Pixel observations at scale: real Atari frame stacks in replay buffers, against the anchors.

`scripts/benchmark.py --workloads=atari` calls `atari_rows`. The steps come from ALE:
`FrameStackObservation(AtariPreprocessing(gym.make("<Game>NoFrameskip-v4")), 4)` driven by a
seeded sticky random policy (the previous action again with probability `STICKY`), generated
once and cached as an uncompressed npz under `--atari_cache_dir`, keyed by env, steps and seed.
The cache holds every distinct frame once, each step's state and next state as 4 frame indices
(the true terminal stack included) and a hash of every stack.

Every buffer is measured in a fresh process of its own (`python scripts/bench_atari.py --child
JSON`): the RSS (VmRSS) before the buffer is made (after a small buffer of the same kind was
made and dropped, so that imports are not counted), after every chunk of adds and its peak
(VmHWM, reset after the baseline where the kernel lets it), then inserts (steps/s, the whole fill),
sampling (batches/s of 32 transitions as torch tensors: states, actions, rewards, next states,
dones) and correctness: the fraction of sampled (state, next state) pairs that are a real
consecutive pair of the env run, hashed as stacks (a terminal transition's next state is the
true terminal stack).
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STACK = 4
FRAME = (84, 84)
BATCH = 32
STICKY = 0.25
CHUNKS = 20  # RSS readings while filling
CHECK_BATCHES = 50  # batches whose pairs are checked against the env run (not timed)
WARMUP_BATCHES = 10
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "replay_service_bench")
RING = "frame ring (numpy, frames once)"
SB3_OPT = "sb3 optimize_memory_usage=True"
SB3_FULL = "sb3 optimize_memory_usage=False"
TORCHRL = "torchrl LazyTensorStorage"


# ------------------------------------------------------------------------------ the env run


def stack_hash(stack: Any) -> int:
    """A stable 63-bit hash of one frame stack's bytes (the same in every process)."""
    data = np.ascontiguousarray(np.asarray(stack, dtype=np.uint8)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def generate(env_id: str, steps: int, seed: int) -> dict[str, np.ndarray]:
    """Runs the frame-stacked env for `steps` steps of a seeded sticky random policy.

    Args:
      env_id: A gymnasium id of ALE's, e.g. "BreakoutNoFrameskip-v4".
      steps: Transitions to record.
      seed: Seeds the env's reset and the policy.

    Returns:
      frames (F, 84, 84) uint8, every distinct frame once in order; state_idx and next_idx
      (steps, 4) int32 indices of each transition's stacks into frames; actions, rewards,
      terminated, truncated; state_hash and next_hash (steps,) of `stack_hash`; n_actions.
    """
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = FrameStackObservation(AtariPreprocessing(gym.make(env_id)), STACK)
    rng = np.random.default_rng(seed)
    frames: list[np.ndarray] = []
    state_idx = np.empty((steps, STACK), np.int32)
    next_idx = np.empty((steps, STACK), np.int32)
    actions = np.empty(steps, np.int64)
    rewards = np.empty(steps, np.float32)
    terminated = np.zeros(steps, bool)
    truncated = np.zeros(steps, bool)
    state_hash = np.empty(steps, np.int64)
    next_hash = np.empty(steps, np.int64)
    n_actions = int(env.action_space.n)
    obs, _ = env.reset(seed=seed)
    frames.append(obs[-1].copy())
    current = [0] * STACK  # reset padding: the first frame repeated
    current_hash = stack_hash(obs)
    action = 0
    for t in range(steps):
        if rng.random() >= STICKY:
            action = int(rng.integers(n_actions))
        obs, reward, term, trunc, _ = env.step(action)
        frames.append(obs[-1].copy())
        following = [*current[1:], len(frames) - 1]
        state_idx[t], next_idx[t] = current, following
        actions[t], rewards[t], terminated[t], truncated[t] = action, reward, term, trunc
        state_hash[t], next_hash[t] = current_hash, stack_hash(obs)
        if t < 50:  # the indices rebuild the env's stacks
            assert np.array_equal(np.stack([frames[i] for i in following]), obs)
        if term or trunc:
            obs, _ = env.reset()
            frames.append(obs[-1].copy())
            current = [len(frames) - 1] * STACK
            current_hash = stack_hash(obs)
        else:
            current, current_hash = following, int(next_hash[t])
    env.close()
    return {
        "frames": np.stack(frames),
        "state_idx": state_idx,
        "next_idx": next_idx,
        "actions": actions,
        "rewards": rewards,
        "terminated": terminated,
        "truncated": truncated,
        "state_hash": state_hash,
        "next_hash": next_hash,
        "n_actions": np.array(n_actions),
    }


def cached_run(env_id: str, steps: int, seed: int, cache_dir: str) -> str:
    """The path of the npz of `generate(env_id, steps, seed)`, generated on first use."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"{env_id}_{steps}_{seed}.npz")
    if not os.path.exists(path):
        data = generate(env_id, steps, seed)
        partial = path + f".{os.getpid()}.tmp.npz"
        np.savez(partial, **data)  # uncompressed: loads without temporaries
        os.replace(partial, path)
    return path


def load_run(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


# ------------------------------------------------------------------------------ the buffers


class Buffer:
    """One buffer as a user drives it: `add` a transition, `batches` of torch tensors."""

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Waits until every add is stored."""

    def batches(self) -> Iterator[tuple[Any, ...]]:
        """Endless (states, actions, rewards, next_states, dones) torch batches of `BATCH`."""
        raise NotImplementedError

    def close(self) -> None:
        """Frees what the buffer holds outside this process's heap."""


def spaces(n_actions: int) -> tuple[Any, Any]:
    import gymnasium as gym

    box = gym.spaces.Box(0, 255, (STACK, *FRAME), np.uint8)
    return box, gym.spaces.Discrete(n_actions)


class Ours(Buffer):
    """`ReplayBufferManager.from_spaces(...)` with `options`, a transition writer and
    `torch_batches(BATCH, transitions=True)`."""

    def __init__(self, capacity: int, n_actions: int, options: dict[str, Any]) -> None:
        from replay_service import ReplayBufferManager

        self._dir = tempfile.mkdtemp(prefix="replay_bench_atari_")
        self.manager = ReplayBufferManager.from_spaces(
            *spaces(n_actions),
            capacity=capacity,
            checkpoint_dir=os.path.join(self._dir, "replay"),
            **options,
        )
        self.manager.create_replay_buffer()
        self.writer = self.manager.transition_writer()

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        self.writer.add(s, a, r, ns, term, trunc)

    def flush(self) -> None:
        self.writer.flush()

    def batches(self) -> Iterator[tuple[Any, ...]]:
        with self.manager.torch_batches(BATCH, transitions=True) as stream:
            for b in stream:
                yield b.states, b.actions, b.rewards, b.next_states, b.dones

    def close(self) -> None:
        self.writer.close()
        self.manager.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class Sb3(Buffer):
    """Stable-Baselines3's `ReplayBuffer`, one env, sampled with `.sample(BATCH)`."""

    def __init__(self, capacity: int, n_actions: int, optimize: bool) -> None:
        from stable_baselines3.common.buffers import ReplayBuffer

        self.buffer = ReplayBuffer(
            capacity,
            *spaces(n_actions),
            device="cpu",
            optimize_memory_usage=optimize,
            handle_timeout_termination=False,  # SB3 refuses it with optimize_memory_usage
        )

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        self.buffer.add(s[None], ns[None], np.array([a]), np.array([r]), np.array([term]), [{}])

    def batches(self) -> Iterator[tuple[Any, ...]]:
        while True:
            b = self.buffer.sample(BATCH)
            yield b.observations, b.actions, b.rewards, b.next_observations, b.dones


class FrameRing(Buffer):
    """Dopamine-style: a numpy ring storing each frame once (the newest of each next state,
    and an episode's first), the stacks rebuilt at sample time (reset padding: the episode's
    first frame repeats)."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity, self.frames_capacity = capacity, capacity + capacity // 8 + 2 * STACK
        self.frames = np.zeros((self.frames_capacity, *FRAME), np.uint8)
        self.newest = np.zeros(capacity, np.int64)  # absolute frame number of s_t's newest
        self.first = np.zeros(capacity, np.int64)  # absolute frame number of the episode's first
        self.actions = np.zeros(capacity, np.int64)
        self.rewards = np.zeros(capacity, np.float32)
        self.dones = np.zeros(capacity, bool)
        self.written = self.frame_count = 0
        self.episode_start = -1  # no episode open
        self.rng = np.random.default_rng(seed)

    def _push(self, frame: Any) -> int:
        self.frames[self.frame_count % self.frames_capacity] = frame
        self.frame_count += 1
        return self.frame_count - 1

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        if self.episode_start < 0:
            self.episode_start = self._push(s[-1])
        slot = self.written % self.capacity
        self.newest[slot], self.first[slot] = self.frame_count - 1, self.episode_start
        self.actions[slot], self.rewards[slot], self.dones[slot] = a, r, term
        self._push(ns[-1])
        self.written += 1
        if term or trunc:
            self.episode_start = -1

    def batches(self) -> Iterator[tuple[Any, ...]]:
        import torch

        offsets = np.arange(1 - STACK, 2)  # s_t: [-3, 0], s_t+1: [-2, 1]
        while True:
            slots = self.rng.integers(min(self.written, self.capacity), size=BATCH)
            numbers = np.maximum(self.newest[slots, None] + offsets, self.first[slots, None])
            oldest_kept = self.frame_count - self.frames_capacity
            stale = numbers[:, 0] < oldest_kept  # frames overwritten: draw again
            while stale.any():
                slots[stale] = self.rng.integers(min(self.written, self.capacity), size=stale.sum())
                numbers = np.maximum(self.newest[slots, None] + offsets, self.first[slots, None])
                stale = numbers[:, 0] < oldest_kept
            frames = self.frames[numbers % self.frames_capacity]  # (B, STACK + 1, 84, 84)
            yield (
                torch.from_numpy(frames[:, :STACK]),
                torch.from_numpy(self.actions[slots]),
                torch.from_numpy(self.rewards[slots]),
                torch.from_numpy(frames[:, 1:]),
                torch.from_numpy(self.dones[slots]),
            )


class TorchRL(Buffer):
    """TorchRL's `ReplayBuffer(LazyTensorStorage)`, one TensorDict per transition."""

    def __init__(self, capacity: int, device: str = "cpu", batch_size: int | None = BATCH) -> None:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self.buffer = ReplayBuffer(
            storage=LazyTensorStorage(capacity, device=device), batch_size=batch_size
        )

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        import torch
        from tensordict import TensorDict

        self.buffer.add(
            TensorDict(
                {
                    "obs": torch.from_numpy(s),
                    "action": torch.tensor(a),
                    "reward": torch.tensor(r),
                    "next_obs": torch.from_numpy(ns),
                    "done": torch.tensor(term),
                },
                batch_size=[],
            )
        )

    def batches(self) -> Iterator[tuple[Any, ...]]:
        while True:
            b = self.buffer.sample()
            yield b["obs"], b["action"], b["reward"], b["next_obs"], b["done"]


def ours_variants() -> dict[str, dict[str, Any]]:
    """Our buffers' names and `from_spaces` options; `frame_stack` and `compression` where the
    manager takes them."""
    from replay_service import ReplayBufferManager

    accepted = inspect.signature(ReplayBufferManager.__init__).parameters
    variants: dict[str, dict[str, Any]] = {
        "ours from_spaces (local)": {},
        "ours storage=memmap": {"storage": "memmap"},
        "ours backend=reverb": {"backend": "reverb"},
    }
    if "frame_stack" in accepted:
        variants["ours frame_stack=4"] = {"frame_stack": STACK}
        variants["ours backend=reverb frame_stack=4"] = {"backend": "reverb", "frame_stack": STACK}
    if "compression" in accepted and "frame_stack" in accepted:
        for codec in ("lz4", "zstd"):
            variants[f"ours frame_stack=4 {codec}"] = {"frame_stack": STACK, "compression": codec}
    return variants


def make_buffer(name: str, capacity: int, n_actions: int) -> Buffer:
    if name in (SB3_OPT, SB3_FULL):
        return Sb3(capacity, n_actions, optimize=name == SB3_OPT)
    if name == RING:
        return FrameRing(capacity)
    if name == TORCHRL:
        return TorchRL(capacity)
    return Ours(capacity, n_actions, ours_variants()[name])


# ---------------------------------------------------------------------------- measurements


def proc_status(field: str) -> int:
    """`field` of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(name: str, path: str, capacity: int, batches: int) -> dict[str, Any]:
    """Fills buffer `name` with the run cached at `path`, in this process, and measures it.

    Args:
      name: A key of `ours_variants()` or an anchor's name.
      path: A `cached_run` npz.
      capacity: Transitions the buffer holds.
      batches: Batches timed when sampling.

    Returns:
      steady_b and peak_b (RSS per stored transition at the end and at the peak, baseline
      subtracted), insert (steps/s), sample (batches/s), correct (fraction of pairs checked).
    """
    data = load_run(path)
    frames, sidx, nidx = data["frames"], data["state_idx"], data["next_idx"]
    acts, rews = data["actions"], data["rewards"]
    terms, truncs = data["terminated"], data["truncated"]
    pairs = set(zip(data["state_hash"].tolist(), data["next_hash"].tolist(), strict=True))
    steps = len(acts)
    n_actions = int(data["n_actions"])
    # A small buffer of the same kind first: the imports and one-time set-up it brings (torch,
    # TensorFlow, a Reverb server's libraries) are not the buffer's memory.
    warm = make_buffer(name, 8, n_actions)
    for t in range(16):
        warm.add(frames[sidx[t]], int(acts[t]), float(rews[t]), frames[nidx[t]], False, False)
    warm.flush()
    next(warm.batches())
    warm.close()
    del warm
    gc.collect()
    baseline = proc_status("VmRSS")
    peak_reset = reset_peak()
    buffer = make_buffer(name, capacity, n_actions)
    readings = []
    insert_s = 0.0
    bounds = np.linspace(0, steps, CHUNKS + 1).astype(int)
    for lo, hi in itertools.pairwise(bounds.tolist()):
        start = time.perf_counter()
        for t in range(lo, hi):
            buffer.add(
                frames[sidx[t]], int(acts[t]), float(rews[t]), frames[nidx[t]], terms[t], truncs[t]
            )
        insert_s += time.perf_counter() - start
        readings.append(proc_status("VmRSS"))
    start = time.perf_counter()
    buffer.flush()
    insert_s += time.perf_counter() - start
    end = proc_status("VmRSS")
    peak = max([*readings, end, proc_status("VmHWM") if peak_reset else 0])
    stored = min(steps, capacity)
    iterator = buffer.batches()
    good = total = 0
    for _ in range(CHECK_BATCHES):
        states, _, _, next_states, _ = next(iterator)
        for s, ns in zip(states.numpy(), next_states.numpy(), strict=True):
            good += (stack_hash(s), stack_hash(ns)) in pairs
            total += 1
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    sample_s = time.perf_counter() - start
    iterator.close()
    buffer.close()
    return {
        "steady_b": (end - baseline) / stored,
        "peak_b": (peak - baseline) / stored,
        "insert": steps / insert_s,
        "sample": batches / sample_s,
        "correct": good / total,
        "peak_from_hwm": peak_reset,
    }


def measure_in_child(name: str, path: str, capacity: int, batches: int) -> dict[str, Any] | None:
    """`measure` in a fresh process (a process reuses memory earlier buffers freed); None
    where the buffer cannot run here (an anchor not installed), with the reason printed."""
    job = json.dumps({"name": name, "path": path, "capacity": capacity, "batches": batches})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", job],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  {name}: did not run ({done.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
    return None


def zstd_frame_bytes(frames: np.ndarray) -> float | None:
    """Mean zstd level-1 size of one frame compressed alone; None without zstandard."""
    try:
        import zstandard
    except ImportError:
        return None
    compressor = zstandard.ZstdCompressor(level=1)
    return float(np.mean([len(compressor.compress(f.tobytes())) for f in frames]))


RowTuple = tuple[str, str, str, float, str, "str | None"]


def atari_rows(
    env_ids: list[str],
    steps: int,
    capacity: int,
    batches: int,
    seed: int,
    cache_dir: str,
    run: Callable[[str, str, int, int], dict[str, Any] | None] = measure_in_child,
) -> list[RowTuple]:
    """Every buffer on every env's cached run: rows (workload, metric, path, value, unit,
    anchor path or None) for `benchmark.Row`.

    Args:
      env_ids: gymnasium ids, e.g. ["BreakoutNoFrameskip-v4", "PongNoFrameskip-v4"].
      steps: Transitions per env run (cached).
      capacity: Transitions every buffer holds.
      batches: Batches of 32 timed per buffer.
      seed: The env's and policy's seed.
      cache_dir: Where the runs are cached.
      run: Measures one buffer (a fresh process each by default).
    """
    rows: list[RowTuple] = []
    for env_id in env_ids:
        workload = env_id.replace("NoFrameskip-v4", "").lower()
        path = cached_run(env_id, steps, seed, cache_dir)
        raw = float(STACK * FRAME[0] * FRAME[1])
        rows.append((workload, "memory", "raw stack bytes (4x84x84)", raw, "B", None))
        floor = zstd_frame_bytes(load_run(path)["frames"])
        if floor is not None:
            rows.append((workload, "memory", "zstd-1 bytes per frame (floor)", floor, "B", None))
        names = [SB3_OPT, SB3_FULL, RING, TORCHRL, *ours_variants()]
        results = {}
        for name in names:
            results[name] = run(name, path, capacity, batches)
            print(f"{workload} {name}: {json.dumps(results[name])}", flush=True)
        got = {name: r for name, r in results.items() if r is not None}
        for metric, key, unit, anchor in (
            ("memory", "steady_b", "B", RING),
            ("memory", "peak_b", "B", RING),
            ("insert", "insert", "st/s", SB3_OPT),
            ("sample", "sample", "b/s", SB3_OPT),
            ("correct", "correct", "%", None),
        ):
            suffix = " " + {"steady_b": "steady", "peak_b": "peak"}.get(key, key)
            for name, result in got.items():
                value = result[key] * (100 if key == "correct" else 1)
                is_ours = name.startswith("ours")
                target = anchor + suffix if anchor and is_ours else None
                rows.append((workload, metric, name + suffix, value, unit, target))
    return rows


# ------------------------------------------------------------- compressed fills and decode


def episode_cut(data: dict[str, np.ndarray]) -> int:
    """Steps of the run up to and including its last episode's end: cycling them repeats
    whole episodes (each cycle starts with a reset stack after a terminal step)."""
    ends = np.flatnonzero(data["terminated"] | data["truncated"])
    if not len(ends):
        raise ValueError("the env run ends no episode: it cannot be cycled")
    return int(ends[-1]) + 1


def measure_fill(
    name: str, path: str, capacity: int, steps: int, readings: list[int], batches: int
) -> dict[str, Any]:
    """Fills buffer `name` with `steps` transitions, the run at `path` cycled by whole
    episodes (`episode_cut`), and reads the RSS at each of `readings` (steps written).

    Returns:
      baseline (RSS before the buffer, bytes); per reading: rss and rss_b (RSS above the
      baseline per stored transition), table_b (the table's own `nbytes` per stored
      transition, ours only), insert (steps/s so far); peak_b (VmHWM above the baseline per
      stored transition at the end); sample (batches/s of `batches` batches at the end).
    """
    data = load_run(path)
    frames, sidx, nidx = data["frames"], data["state_idx"], data["next_idx"]
    acts, rews = data["actions"], data["rewards"]
    terms, truncs = data["terminated"], data["truncated"]
    cut = episode_cut(data)
    n_actions = int(data["n_actions"])
    warm = make_buffer(name, 8, n_actions)
    for t in range(16):
        warm.add(frames[sidx[t]], int(acts[t]), float(rews[t]), frames[nidx[t]], False, False)
    warm.flush()
    next(warm.batches())
    warm.close()
    del warm
    gc.collect()
    baseline = proc_status("VmRSS")
    peak_reset = reset_peak()
    buffer = make_buffer(name, capacity, n_actions)
    table = None
    if isinstance(buffer, Ours):
        backend = buffer.manager._backend
        table = getattr(backend, "client", None) and backend.client.table(buffer.manager.table_name)
    out: dict[str, Any] = {"baseline": baseline, "cycled": cut, "readings": {}}
    insert_s = 0.0
    written = 0
    for stop in sorted({*readings, steps}):
        start = time.perf_counter()
        for t in range(written, stop):
            r = t % cut
            buffer.add(
                frames[sidx[r]], int(acts[r]), float(rews[r]), frames[nidx[r]], terms[r], truncs[r]
            )
        buffer.flush()
        insert_s += time.perf_counter() - start
        written = stop
        stored = min(written, capacity)
        rss = proc_status("VmRSS")
        out["readings"][str(written)] = {
            "rss": rss,
            "rss_b": (rss - baseline) / stored,
            "table_b": None if table is None else table.nbytes / stored,
            "insert": written / insert_s,
        }
        print(f"  {name}: {written} steps {json.dumps(out['readings'][str(written)])}", flush=True)
    peak = max(proc_status("VmRSS"), proc_status("VmHWM") if peak_reset else 0)
    out["peak_b"] = (peak - baseline) / min(written, capacity)
    iterator = buffer.batches()
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    out["sample"] = batches / (time.perf_counter() - start)
    iterator.close()
    buffer.close()
    return out


def measure_interleaved(
    names: list[str], path: str, capacity: int, batches: int, rounds: int
) -> dict[str, Any]:
    """Every buffer of `names` filled with the run at `path` in this process, then sampled in
    turn, `batches` batches each, `rounds` times: a load that drifts during the run weighs on
    every buffer alike, so the per-round ratios to the first buffer hold.

    Returns:
      rates: per buffer its batches/s per round; ratio: per buffer the median of its
      per-round ratios to the first buffer's rate.
    """
    data = load_run(path)
    frames, sidx, nidx = data["frames"], data["state_idx"], data["next_idx"]
    cut = episode_cut(data)
    steps = min(capacity, cut)
    iterators = {}
    for name in names:
        buffer = make_buffer(name, capacity, int(data["n_actions"]))
        for t in range(steps):
            buffer.add(
                frames[sidx[t]],
                int(data["actions"][t]),
                float(data["rewards"][t]),
                frames[nidx[t]],
                data["terminated"][t],
                data["truncated"][t],
            )
        buffer.flush()
        iterators[name] = buffer.batches()
        for _ in range(WARMUP_BATCHES):
            next(iterators[name])
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, iterator in iterators.items():
            start = time.perf_counter()
            for _ in range(batches):
                next(iterator)
            rates[name].append(batches / (time.perf_counter() - start))
    first = np.array(rates[names[0]])
    return {
        "rates": rates,
        "ratio": {name: float(np.median(np.array(r) / first)) for name, r in rates.items()},
    }


def run_child(job: dict[str, Any]) -> dict[str, Any] | None:
    """`job` (`measure`'s or, with "fill", `measure_fill`'s arguments) in a fresh process;
    None where it did not run, with the reason printed."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
        print(line, flush=True)
    print(f"  {job['name']}: did not run ({done.stderr.strip().splitlines()[-3:]})")
    return None


def main(argv: list[str]) -> None:
    """`sample`: batches/s of the buffers named, `--repeats` rounds (each buffer once per
    round, in turn, in fresh processes), the median and its ratio to the first buffer's.
    `insert`: the same rounds, the steps/s of their fills (`--run_steps` transitions into a
    buffer of `--capacity`).
    `interleaved`: the buffers in one process, sampled in turn (`measure_interleaved`), the
    ratios to the first buffer's rate, `--repeats` processes.
    `fill`: RSS while `--steps` transitions (the env run cycled by whole episodes) fill a
    buffer of `--capacity`, read at `--readings`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("mode", choices=["sample", "insert", "interleaved", "fill"])
    parser.add_argument("--env", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--run_steps", type=int, default=40_000, help="Steps of the env run.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache_dir", default=DEFAULT_CACHE)
    parser.add_argument("--capacity", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=None, help="fill: transitions written.")
    parser.add_argument("--readings", default="200000,1000000", help="fill: steps, commas.")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--buffers",
        default="ours backend=reverb,ours frame_stack=4 lz4,ours frame_stack=4 zstd",
        help="Commas (a comma inside parentheses belongs to the name, as in the frame ring's); "
        "sample: the first is the reference of the ratios.",
    )
    args = parser.parse_args(argv)
    path = cached_run(args.env, args.run_steps, args.seed, args.cache_dir)
    names = [n.strip() for n in re.split(r",(?![^(]*\))", args.buffers) if n.strip()]
    if args.mode == "fill":
        readings = [int(r) for r in args.readings.split(",") if r]
        steps = args.steps or max(readings)
        for name in names:
            job = {
                "fill": True,
                "name": name,
                "path": path,
                "capacity": args.capacity,
                "steps": steps,
                "readings": readings,
                "batches": args.batches,
            }
            print(f"{name}: {json.dumps(run_child(job))}", flush=True)
        return
    capacity = min(args.capacity, args.run_steps)
    if args.mode == "interleaved":
        for repeat in range(args.repeats):
            job = {
                "interleaved": True,
                "names": names,
                "path": path,
                "capacity": capacity,
                "batches": args.batches,
                "rounds": 10,
            }
            result = run_child(job | {"name": "interleaved"})
            if result is None:
                continue
            for name in names:
                median = float(np.median(result["rates"][name]))
                print(
                    f"repeat {repeat} {name}: median {median:.0f} batches/s, "
                    f"{result['ratio'][name]:.2f}x {names[0]}",
                    flush=True,
                )
        return
    key, unit = ("insert", "steps/s") if args.mode == "insert" else ("sample", "batches/s")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        for name in names:
            job = {"name": name, "path": path, "capacity": capacity, "batches": args.batches}
            result = run_child(job)
            if result is not None:
                rates[name].append(result[key])
                print(f"round {round_} {name}: {result[key]:.0f} {unit}", flush=True)
    reference = float(np.median(rates[names[0]])) if rates[names[0]] else float("nan")
    for name in names:
        median = float(np.median(rates[name])) if rates[name] else float("nan")
        print(f"{name}: median {median:.0f} {unit}, {median / reference:.2f}x {names[0]}")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    job = json.loads(sys.argv[2])
    if job.get("interleaved"):
        result = measure_interleaved(
            job["names"], job["path"], job["capacity"], job["batches"], job["rounds"]
        )
    elif job.get("fill"):
        result = measure_fill(
            job["name"],
            job["path"],
            job["capacity"],
            job["steps"],
            job["readings"],
            job["batches"],
        )
    else:
        result = measure(job["name"], job["path"], job["capacity"], job["batches"])
    print("RESULT " + json.dumps(result), flush=True)
elif __name__ == "__main__":
    main(sys.argv[1:])
