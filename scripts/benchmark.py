"""Speed and memory of replay_service against its anchors, measured side by side in one run.

    .venv/bin/python scripts/benchmark.py [--workloads=cartpole,image] [--json=out.json]
    .venv/bin/python scripts/benchmark.py --workloads=atari,sizes --repeats=1
    make benchmark        # installs the optional TorchRL and cpprb anchors, then runs this

For each workload (a CartPole-sized step, and an 84x84x4 uint8 image step) it measures:
  insert   steps/s through this project's observer and TransitionWriter (`add`, and
           `add_multi` from 8 envs: env steps/s), and through the anchors: TF-Agents'
           ReverbAddTrajectoryObserver, a raw TrajectoryWriter, a raw StructuredWriter
  sample   items/s at batch 256 through get_dataset (tf) and torch_batches (torch), and through
           TF-Agents' as_dataset with default settings, a tuned raw TrajectoryDataset and, if
           installed, TorchRL's ReplayBuffer(LazyTensorStorage) (in-process, no server); and
           ShardedReplayBuffer.get_dataset over 2 servers in this process against one server
           holding the same items, taking turns
  ckpt     checkpoint save and restore MB/s, against a plain sequential file write (with fsync)
           of the same number of bytes on the same disk
  memory   resident memory per stored step of the embedded server
  loop     (workload "loop") a CleanRL-style DQN step: add one transition, sample 64 as torch
           transitions, one small Adam step; ours (reverb, local) against a numpy ring buffer,
           taking turns in blocks
  local    the in-process backend (`backend="local"`): observer and `add` inserts, torch and tf
           sampling (against TorchRL's and cpprb's ReplayBuffer used directly; `add` against
           cpprb's too), checkpoint save/restore
           (against the plain write), resident memory per stored item (against its raw bytes)
  atari    (workload "atari", scripts/bench_atari.py) real ALE frame stacks (Breakout, Pong),
           each buffer in a fresh process: RSS per stored transition steady and peak, inserts,
           batches/s of 32 torch transitions and the fraction of sampled (state, next state)
           pairs that are real consecutive pairs; ours (from_spaces, memmap, reverb, and
           frame_stack/compression where the manager takes them) against SB3's ReplayBuffer,
           a numpy frame ring, TorchRL's and zstd's bytes per frame
  sizes    (workload "sizes", scripts/bench_sizes.py) CartPole transitions sampled from full
           buffers of 10k to 1M, ours as torch transitions against cpprb's
  sb3      (workload "sb3") Stable-Baselines3's DQN `learn()` on CartPole with default
           hyperparameters (`add` every step, a batch of 32 every 4), env steps/s with
           `replay_buffer_class=ReverbReplayBuffer` (local backend) against SB3's own
           ReplayBuffer, after an untimed learn() of each, both learning by turns in calls of
           1,500 steps (who goes first alternating); also
           per CPU second of the process (the wall clock of a shared machine counts others' work)
and prints every figure with its ratio ours/anchor: the median of `--repeats` runs of every
row, each run measuring ours and its anchors side by side. Timings are wall-clock on this
machine now: compare ratios, not absolute numbers, across machines.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Measure the checkout this script belongs to, not whichever copy the interpreter has installed
# (a worktree run with another checkout's virtual environment imported that checkout's code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import reverb
import tensorflow as tf
from absl import app, flags
from tf_agents.replay_buffers import reverb_utils
from tf_agents.trajectories import trajectory as trajectory_lib

from replay_service import ReplayBufferManager, Timeouts
from replay_service.backends import resolve_auto_layout
from replay_service.specs.nests import spec_from_description
from replay_service.storage.store import CheckpointStore

_WORKLOADS = flags.DEFINE_list(
    "workloads",
    ["cartpole", "image", "loop"],
    "cartpole, image (inserts, sampling, checkpoints, memory), loop (the training loop), "
    "sharded (only the sharded sampling row, on CartPole steps), atari (real ALE frame stacks) "
    "sizes (sampling full CartPole buffers of every size) and/or sb3 (SB3's DQN learn() with "
    "our replay_buffer_class against its own).",
)
_ATARI_ENVS = flags.DEFINE_list(
    "atari_envs", ["BreakoutNoFrameskip-v4", "PongNoFrameskip-v4"], "ALE envs (atari)."
)
_ATARI_STEPS = flags.DEFINE_integer("atari_steps", 40_000, "Steps of each env run (atari).")
_ATARI_CAPACITY = flags.DEFINE_integer("atari_capacity", 30_000, "Transitions held (atari).")
_ATARI_BATCHES = flags.DEFINE_integer("atari_batches", 1_000, "Batches of 32 timed (atari).")
_ATARI_SEED = flags.DEFINE_integer("atari_seed", 0, "Seed of the env runs (atari).")
_ATARI_CACHE = flags.DEFINE_string(
    "atari_cache_dir",
    os.path.join(os.path.expanduser("~"), ".cache", "replay_service_bench"),
    "Where the env runs are cached (npz keyed by env, steps and seed).",
)
_SB3_STEPS = flags.DEFINE_integer("sb3_steps", 30_000, "DQN learn() steps per buffer (sb3).")
_SIZES = flags.DEFINE_list("sizes", ["10000", "100000", "1000000"], "Buffer sizes (sizes).")
_SIZES_BATCHES = flags.DEFINE_integer("sizes_batches", 2_000, "Batches of 256 timed (sizes).")
_STEPS = flags.DEFINE_integer("steps", 20_000, "Steps inserted per writer (cartpole).")
_IMAGE_STEPS = flags.DEFINE_integer("image_steps", 2_000, "Steps inserted per writer (image).")
_BATCHES = flags.DEFINE_integer("batches", 60, "Batches of 256 timed per sampler.")
_JSON = flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of every workload; the median is printed.")
_BACKENDS = flags.DEFINE_list("backends", ["reverb", "local"], "reverb and/or local rows.")
_LAYOUTS = flags.DEFINE_list(
    "layouts",
    ["packed", "nested"],
    "Reverb table layouts measured side by side, the default first (our rows of layouts other "
    "than nested, on which the anchors are measured, get a [layout] suffix).",
)
_EPISODE = flags.DEFINE_integer("episode", 200, "Steps per episode of the inserted steps.")
_MEMORY_SCALE = flags.DEFINE_integer(
    "memory_scale",
    4,
    "Every memory row fills a fresh buffer with this many times the workload's steps: the "
    "writer's and allocator's fixed costs and the RSS's jumps then weigh less per step.",
)
_MEASURE_MEMORY = flags.DEFINE_string(
    "measure_memory",
    None,
    "Internal, 'workload:backend:layout:sequence_length' (layout 'tf-agents': TF-Agents' "
    "observer on a "
    "nested table): only measure the RSS while one observer fills a "
    "fresh buffer, in this process, and print the readings (every memory row runs this in a "
    "process of its own: a process reuses the memory earlier measurements freed).",
)

BATCH = 256
# What `ReplayBufferManager(data_spec, capacity, checkpoint_dir)` stores a new buffer in.
DEFAULT_LAYOUT = resolve_auto_layout(
    "auto", kind="reverb", checkpoint_dir=None, server_address=None
)


def layout_tag(layout: str) -> str:
    """Our rows' suffix for `layout`: none for the nested table the anchors are measured on,
    else the layout, marked where it is the default."""
    if layout == "nested":
        return ""
    return f" [{layout}, default]" if layout == DEFAULT_LAYOUT else f" [{layout}]"


SEQUENCE_LENGTH = 2
EPISODE = 200
NUM_ENVS = 8
# A memory row fills a fresh buffer in MEMORY_PARTS parts, reading the RSS after each; the
# figure per step is the slope fitted to the readings after the first MEMORY_SKIP parts.
MEMORY_PARTS = 8
MEMORY_SKIP = 2
_RAW = "raw observation bytes"
MID, FIRST, LAST = 1, 0, 2


@dataclasses.dataclass
class Row:
    """One measured figure and, when it is ours, the anchor it is compared with."""

    workload: str
    metric: str
    path: str
    value: float
    unit: str
    anchor: str | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    """A step shape to measure with."""

    name: str
    observation_shape: tuple[int, ...]
    observation_dtype: str
    steps: int

    def spec(self) -> Any:
        return spec_from_description(
            [
                {
                    "path": "observation",
                    "dtype": self.observation_dtype,
                    "shape": list(self.observation_shape),
                },
                {"path": "action", "dtype": "int64", "shape": []},
            ]
        )

    def trajectories(self) -> list[trajectory_lib.Trajectory]:
        """Pre-built steps in episodes of `EPISODE` steps (building them is not timed). Every
        observation is distinct and random: repeated ones would let Reverb's chunk compression
        understate the memory of real data."""
        rng = np.random.default_rng(0)
        shape = (self.steps, *self.observation_shape)
        if np.dtype(self.observation_dtype).kind == "f":
            observations = rng.standard_normal(shape).astype(self.observation_dtype)
        else:
            observations = rng.integers(0, 255, shape, dtype=self.observation_dtype)
        out = []
        for i in range(self.steps):
            t = i % EPISODE
            step_type = FIRST if t == 0 else LAST if t == EPISODE - 1 else MID
            next_type = LAST if t == EPISODE - 2 else FIRST if t == EPISODE - 1 else MID
            out.append(
                trajectory_lib.Trajectory(
                    np.int32(step_type),
                    observations[i],
                    np.int64(i % 2),
                    (),
                    np.int32(next_type),
                    np.float32(1.0),
                    np.float32(0.0 if t == EPISODE - 2 else 1.0),
                )
            )
        return out


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


# ------------------------------------------------------------------------------------ inserts


def insert_ours(
    manager: ReplayBufferManager, steps: list[Any], rss: list[int] | None = None
) -> float:
    """The observer's insert time; with `rss`, see `insert_with`."""
    _, observer = manager.get_replay_buffer_and_observer()
    return insert_with(observer, steps, rss)


def insert_with(
    observer: Callable[[Any], None], steps: list[Any], rss: list[int] | None = None
) -> float:
    """Times `observer` writing `steps` and flushing. With `rss`, the steps are written in
    `MEMORY_PARTS` equal parts, each flushed, and the process's RSS is appended before the
    first and after every part (read between the timed parts).

    Args:
      observer: A trajectory observer with a `flush()` method.
      steps: The steps to write, in order.
      rss: Where to append the RSS readings, or None.

    Returns:
      The seconds spent writing and flushing.
    """

    def run(part: list[Any]) -> Callable[[], None]:
        def insert() -> None:
            for step in part:
                observer(step)
            observer.flush()  # type: ignore[attr-defined]

        return insert

    if rss is None:
        return timed(run(steps))
    bounds = memory_bounds(len(steps))
    rss.append(rss_bytes())
    seconds = 0.0
    for lo, hi in itertools.pairwise(bounds):
        seconds += timed(run(steps[lo:hi]))
        rss.append(rss_bytes())
    return seconds


def memory_bounds(steps: int) -> list[int]:
    """The step counts at which `insert_with` reads the RSS."""
    return [steps * k // MEMORY_PARTS for k in range(MEMORY_PARTS + 1)]


def insert_transition_writer(manager: ReplayBufferManager, steps: list[Any]) -> float:
    writer = manager.transition_writer()
    obs = [s.observation for s in steps]
    n = len(steps)

    def run() -> None:
        for i in range(n - 1):
            end = i % EPISODE == EPISODE - 2
            writer.add(obs[i], steps[i].action, 1.0, obs[i + 1], end, False)
        writer.flush()

    return timed(run)


def insert_add_multi(manager: ReplayBufferManager, steps: list[Any]) -> float:
    """`add_multi` from `NUM_ENVS` auto-resetting envs, `len(steps)` env steps in all; each env's
    episodes are `EPISODE - 1` transitions, as in the other inserts, but end at other calls."""
    writer = manager.transition_writer()
    calls = len(steps) // NUM_ENVS
    batches = [
        np.stack([step.observation for step in steps[c * NUM_ENVS : (c + 1) * NUM_ENVS]])
        for c in range(calls)
    ]
    offsets = np.arange(NUM_ENVS) * (EPISODE // NUM_ENVS)
    dones = [(c + offsets) % (EPISODE - 1) == EPISODE - 2 for c in range(calls)]
    actions = np.array([steps[e].action for e in range(NUM_ENVS)])
    rewards = np.ones(NUM_ENVS, np.float32)
    truncated = np.zeros(NUM_ENVS, bool)

    def run() -> None:
        for c in range(calls):
            nexts = batches[(c + 1) % calls]
            writer.add_multi(
                batches[c],
                actions,
                rewards,
                nexts,
                dones[c],
                truncated,
                final_states=nexts,
            )
        writer.flush()

    return timed(run) * len(steps) / (calls * NUM_ENVS)


def insert_tf_agents(manager: ReplayBufferManager, steps: list[Any]) -> float:
    observer = reverb_utils.ReverbAddTrajectoryObserver(
        manager.py_client, manager.table_name, SEQUENCE_LENGTH
    )

    def run() -> None:
        for step in steps:
            observer(step)
        observer.flush()
        observer.close()

    return timed(run)


def insert_tf_agents_envs(manager: ReplayBufferManager, steps: list[Any]) -> float:
    """`NUM_ENVS` TF-Agents observers, one per env (it takes unbatched steps only), fed in turn:
    the same work as `add_multi` from `NUM_ENVS` envs, `len(steps)` env steps in all."""
    observers = [
        reverb_utils.ReverbAddTrajectoryObserver(
            manager.py_client, manager.table_name, SEQUENCE_LENGTH
        )
        for _ in range(NUM_ENVS)
    ]
    per_env = len(steps) // NUM_ENVS
    streams = [steps[e * per_env : (e + 1) * per_env] for e in range(NUM_ENVS)]

    def run() -> None:
        for c in range(per_env):
            for observer, stream in zip(observers, streams, strict=True):
                observer(stream[c])
        for observer in observers:
            observer.flush()
            observer.close()

    return timed(run) * len(steps) / (per_env * NUM_ENVS)


def insert_trajectory_writer(manager: ReplayBufferManager, steps: list[Any]) -> float:
    table = manager.table_name

    def run() -> None:
        with manager.py_client.trajectory_writer(num_keep_alive_refs=SEQUENCE_LENGTH) as writer:
            in_episode = 0
            for step in steps:
                writer.append(step)
                in_episode += 1
                if in_episode >= SEQUENCE_LENGTH:
                    window = tf.nest.map_structure(lambda c: c[-SEQUENCE_LENGTH:], writer.history)
                    writer.create_item(table, 1.0, window)
                if step.step_type == LAST:
                    writer.end_episode(timeout_ms=30_000)
                    in_episode = 0
            writer.flush(timeout_ms=30_000)

    return timed(run)


def insert_structured_writer(manager: ReplayBufferManager, steps: list[Any]) -> float:
    from replay_service.backends.reverb.layout_writers import window_config

    config = window_config(manager._data_spec, manager.table_name, SEQUENCE_LENGTH, 1, 1.0)

    def run() -> None:
        writer = manager.py_client.structured_writer([config])
        for step in steps:
            writer.append(step)
            if step.step_type == LAST:
                writer.end_episode(timeout_ms=30_000)
        writer.flush(timeout_ms=30_000)

    return timed(run)


# ------------------------------------------------------------------------------------ samples


def rate(iterator: Iterator[Any], batches: int) -> float:
    next(iterator)  # warm-up: pipeline start, first round trips
    seconds = timed(lambda: [next(iterator) for _ in range(batches)])
    return batches * BATCH / seconds


def sample_rows(
    workload: str, manager: ReplayBufferManager, batches: int, tag: str = ""
) -> list[Row]:
    replay_buffer, _ = manager.get_replay_buffer_and_observer()
    if tag:  # another layout: ours only, against the anchors measured on the nested table
        tf_rate = rate(iter(manager.get_dataset(BATCH, SEQUENCE_LENGTH)), batches)
        rows = [Row(workload, "sample", f"ours tf{tag}", tf_rate, "items/s", "ours tf")]
        as_dataset = replay_buffer.as_dataset(sample_batch_size=BATCH, num_steps=SEQUENCE_LENGTH)
        rows.append(
            Row(
                workload,
                "sample",
                f"tf-agents as_dataset{tag}",
                rate(iter(as_dataset), batches),
                "items/s",
                "tf-agents as_dataset",
            )
        )
        stream = manager.torch_batches(BATCH)
        rows.append(
            Row(
                workload,
                "sample",
                f"ours torch{tag}",
                rate(iter(stream), batches),
                "items/s",
                "ours torch",
            )
        )
        stream.close()
        return rows
    anchors = {
        "tf-agents as_dataset": iter(
            replay_buffer.as_dataset(sample_batch_size=BATCH, num_steps=SEQUENCE_LENGTH)
        ),
        "raw TrajectoryDataset": iter(
            reverb.TrajectoryDataset.from_table_signature(
                manager.server_address,
                manager.table_name,
                max_in_flight_samples_per_worker=4 * BATCH,
            )
            .batch(BATCH, drop_remainder=True)
            .prefetch(4)
        ),
    }
    rows = [
        Row(workload, "sample", name, rate(it, batches), "items/s") for name, it in anchors.items()
    ]
    tf_rate = rate(iter(manager.get_dataset(BATCH, SEQUENCE_LENGTH)), batches)
    rows.append(Row(workload, "sample", "ours tf", tf_rate, "items/s", "tf-agents as_dataset"))
    stream = manager.torch_batches(BATCH)
    rows.append(
        Row(workload, "sample", "ours torch", rate(iter(stream), batches), "items/s", "ours tf")
    )
    stream.close()
    torchrl = torchrl_rate(manager, batches)
    if torchrl is not None:
        rows.append(Row(workload, "sample", "torchrl LazyTensorStorage", torchrl, "items/s"))
    return rows


def torchrl_rate(manager: ReplayBufferManager, batches: int) -> float | None:
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
    except ImportError:
        return None
    size = manager.num_frames()
    batch, _ = next(iter(manager.get_dataset(size if size < 4096 else 4096, SEQUENCE_LENGTH)))
    data = TensorDict(
        {"observation": torch.from_numpy(batch.observation.numpy())}, batch_size=[len(batch.reward)]
    )
    buffer = ReplayBuffer(storage=LazyTensorStorage(size), batch_size=BATCH)
    while len(buffer) < size:
        buffer.extend(data[: size - len(buffer)])
    return rate(iter(buffer.sample, None), batches)


def cpprb_rates(steps: list[Any], capacity: int, batches: int) -> tuple[float, float] | None:
    """cpprb's `ReplayBuffer` (a C++ ring in this process) with its default settings, on the
    transitions `insert_transition_writer` adds: `add` steps/s, one transition per call, and
    `sample` items/s at batch `BATCH` as torch tensors (as our torch batches are); None without
    cpprb."""
    try:
        import cpprb
        import torch
    except ImportError:
        return None
    obs = [s.observation for s in steps]
    shape = tuple(obs[0].shape)
    buffer = cpprb.ReplayBuffer(
        capacity,
        {
            "obs": {"shape": shape, "dtype": obs[0].dtype},
            "act": {"shape": 1, "dtype": np.int64},
            "rew": {},
            "next_obs": {"shape": shape, "dtype": obs[0].dtype},
            "done": {},
        },
    )
    n = len(steps)

    def add() -> None:
        for i in range(n - 1):
            end = i % EPISODE == EPISODE - 2
            buffer.add(obs=obs[i], act=steps[i].action, rew=1.0, next_obs=obs[i + 1], done=end)

    add_rate = (n - 1) / timed(add)

    def torch_batches() -> Iterator[Any]:
        while True:
            yield {k: torch.from_numpy(v) for k, v in buffer.sample(BATCH).items()}

    return add_rate, rate(torch_batches(), batches)


SHARDS = 2
SHARD_ROUNDS = 3


def sharded_rows(workload: Workload, steps: list[Any], batches: int, root: str) -> list[Row]:
    """`ShardedReplayBuffer.get_dataset` over `SHARDS` servers in this process against one
    server's `get_dataset` holding the same items, taking turns in `SHARD_ROUNDS` rounds."""
    from replay_service.distributed.shard_config import ShardedConfig
    from replay_service.distributed.sharding import ShardedReplayBuffer

    spec = workload.spec()
    per_shard = len(steps) // SHARDS

    def filled(name: str, part: list[Any]) -> ReplayBufferManager:
        manager = ReplayBufferManager(
            spec, 2 * workload.steps, os.path.join(root, name), SEQUENCE_LENGTH
        )
        manager.create_replay_buffer()
        insert_ours(manager, part)
        return manager

    one = filled("one_server", steps[: per_shard * SHARDS])
    shard_managers = [
        filled(f"shard{i}", steps[i * per_shard : (i + 1) * per_shard]) for i in range(SHARDS)
    ]
    sharded = ShardedReplayBuffer(
        ShardedConfig(tuple(m.server_address for m in shard_managers)), spec, 2 * workload.steps
    ).load()
    paths = {
        "one server get_dataset": lambda: iter(one.get_dataset(BATCH, SEQUENCE_LENGTH)),
        f"ours sharded ({SHARDS} shards)": lambda: iter(
            sharded.get_dataset(BATCH, SEQUENCE_LENGTH)
        ),
    }
    seconds = dict.fromkeys(paths, 0.0)
    per_round = batches
    for _ in range(SHARD_ROUNDS):
        for name, make in paths.items():
            iterator = make()
            for _ in range(3):  # warm-up: pipeline start, sample streams filling
                next(iterator)
            seconds[name] += timed(lambda it=iterator: [next(it) for _ in range(per_round)])
            del iterator
    sharded.close()
    for manager in [one, *shard_managers]:
        manager.close()
    items = per_round * SHARD_ROUNDS * BATCH
    names = list(paths)
    return [
        Row(workload.name, "sample", names[0], items / seconds[names[0]], "items/s"),
        Row(workload.name, "sample", names[1], items / seconds[names[1]], "items/s", names[0]),
    ]


# -------------------------------------------------------------------------------- checkpoints


def checkpoint_rows(
    workload: str, manager: ReplayBufferManager, spec: Any, tag: str = ""
) -> list[Row]:
    saved_at = timed(manager.checkpoint)
    path = CheckpointStore(manager.checkpoint_dir).latest().path
    size = dir_bytes(path)
    root = manager.checkpoint_dir
    capacity = manager.table_config.capacity
    layout = manager.table_config.layout
    manager.close()

    def restore() -> None:
        with ReplayBufferManager(spec, capacity, root, SEQUENCE_LENGTH, layout=layout) as restored:
            restored.load_replay_buffer()

    restore_s = timed(restore)
    disk_s = disk_write_seconds(size, root)
    mb = size / 1e6
    plain = f"plain file write+fsync{tag}"
    return [
        Row(workload, "ckpt", plain, mb / disk_s, "MB/s"),
        Row(workload, "ckpt", f"ours save{tag}", mb / saved_at, "MB/s", plain),
        Row(workload, "ckpt", f"ours restore{tag}", mb / restore_s, "MB/s", plain),
        Row(workload, "ckpt", f"checkpoint size{tag}", mb, "MB"),
    ]


def disk_write_seconds(size: int, directory: str) -> float:
    path = os.path.join(directory, "..", "disk_probe.bin")
    block = os.urandom(1 << 20)

    def write() -> None:
        with open(path, "wb") as f:
            for _ in range(max(1, size >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    seconds = timed(write)
    os.remove(path)
    return seconds * size / max(1 << 20, (size >> 20) << 20)


# ------------------------------------------------------------------------------ local backend


# In-process samplers (ours, TorchRL's, cpprb's) take tens of microseconds a batch: their rows
# time this many times `--batches`, for figures steadier than a timer's resolution.
IN_PROCESS_BATCHES = 20


def local_rows(workload: Workload, steps: list[Any], batches: int, root: str) -> list[Row]:
    """The in-process backend: inserts, memory, sampling and checkpoints."""
    batches *= IN_PROCESS_BATCHES
    name = workload.name
    spec = workload.spec()
    capacity = 2 * workload.steps
    directory = os.path.join(root, "local")
    rows: list[Row] = []
    manager = ReplayBufferManager(
        spec, capacity, directory, SEQUENCE_LENGTH, timeouts=Timeouts(sample=120), backend="local"
    )
    manager.create_replay_buffer()
    rows.append(
        Row(
            name,
            "local",
            "local observer",
            len(steps) / insert_ours(manager, steps),
            "steps/s",
            "tf-agents observer",
        )
    )
    rss = fresh_process_memory(workload, "local", "nested")
    per_item = memory_per_step(rss)[0] * rss[-2] / rss[-1]  # x steps written / items stored
    item_bytes = SEQUENCE_LENGTH * step_bytes(spec)
    rows.append(Row(name, "local", "raw item bytes", float(item_bytes), "B"))
    rows.append(Row(name, "local", "local RSS per stored item", per_item, "B", "raw item bytes"))
    # The whole buffer, full: from before it was created (its per-item arrays included) to
    # the last item, per stored step (its capacity holds every item written: every step
    # written is stored), at the benchmark's sequence length and at 20.
    rows.append(Row(name, "local", "raw step bytes", float(step_bytes(spec)), "B"))
    for length in (SEQUENCE_LENGTH, 20):
        if length != SEQUENCE_LENGTH:
            rss = fresh_process_memory(workload, "local", "nested", length)
        full = (rss[-4] - rss[-3]) / rss[-2]
        rows.append(
            Row(
                name,
                "local",
                f"  full buffer incl. tables, per stored step, sequence_length {length}",
                full,
                "B",
                "raw step bytes",
            )
        )
    manager.clear()
    cpprb = cpprb_rates(steps, capacity, batches)
    add_rate = len(steps) / insert_transition_writer(manager, steps)
    rows.append(
        Row(name, "local", "local TransitionWriter.add", add_rate, "steps/s", "tf-agents observer")
    )
    if cpprb is not None:
        rows.append(Row(name, "local", "cpprb ReplayBuffer.add", cpprb[0], "steps/s"))
        rows.append(
            Row(name, "local", "local add vs cpprb", add_rate, "steps/s", "cpprb ReplayBuffer.add")
        )
    torchrl = torchrl_rate(manager, batches)
    if torchrl is not None:
        rows.append(Row(name, "local", "torchrl ReplayBuffer", torchrl, "items/s"))
    if cpprb is not None:
        rows.append(Row(name, "local", "cpprb ReplayBuffer.sample", cpprb[1], "items/s"))
    stream = manager.torch_batches(BATCH)
    rows.append(
        Row(
            name,
            "local",
            "local torch",
            rate(iter(stream), batches),
            "items/s",
            "torchrl ReplayBuffer" if torchrl is not None else None,
        )
    )
    stream.close()
    if cpprb is not None:
        rows.append(
            Row(
                name,
                "local",
                "local torch vs cpprb",
                rows[-1].value,
                "items/s",
                "cpprb ReplayBuffer.sample",
            )
        )
        # What cpprb's sample gives: transitions (states, actions, rewards, next states, dones).
        stream = manager.torch_batches(BATCH, transitions=True)
        rows.append(
            Row(
                name,
                "local",
                "local torch transitions vs cpprb",
                rate(iter(stream), batches),
                "items/s",
                "cpprb ReplayBuffer.sample",
            )
        )
        stream.close()
    rows.append(
        Row(
            name,
            "local",
            "local tf",
            rate(iter(manager.get_dataset(BATCH)), batches),
            "items/s",
            "local torch",
        )
    )
    saved_s = timed(manager.checkpoint)
    size = dir_bytes(CheckpointStore(directory).latest().path)
    manager.close()

    def restore() -> None:
        with ReplayBufferManager(
            spec, capacity, directory, SEQUENCE_LENGTH, backend="local"
        ) as restored:
            restored.load_replay_buffer()

    restore_s = timed(restore)
    mb = size / 1e6
    rows += [
        Row(
            name,
            "local",
            "plain file write+fsync",
            mb / disk_write_seconds(size, directory),
            "MB/s",
        ),
        Row(name, "local", "local ckpt save", mb / saved_s, "MB/s", "plain file write+fsync"),
        Row(name, "local", "local ckpt restore", mb / restore_s, "MB/s", "plain file write+fsync"),
    ]
    return rows


def step_bytes(spec: Any) -> int:
    return sum(int(np.prod(s.shape)) * s.dtype.size for s in tf.nest.flatten(spec))


# ----------------------------------------------------------------------------- training loop


LOOP_STEPS = 3_000
LOOP_WARMUP = 500
LOOP_BATCH = 64
# The timed steps are run in blocks, the ring buffer's and ours taking turns, so that a change
# in the machine's load falls on all of them alike.
LOOP_BLOCKS = 6


def loop_rows(root: str) -> list[Row]:
    """A CleanRL-style single-process loop on CartPole-sized steps: per step, add one
    transition, sample a batch of 64 transitions as torch tensors and take one Adam step of a
    small MLP; ours (Reverb and local) against a numpy ring buffer doing the same."""
    import torch

    spec = Workload("cartpole", (4,), "float32", 0).spec()
    rng = np.random.default_rng(0)
    observations = rng.standard_normal((LOOP_STEPS + LOOP_WARMUP + 1, 4)).astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 2),
    )
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)

    def learn(states: Any, actions: Any, rewards: Any, next_states: Any, dones: Any) -> None:
        with torch.no_grad():
            target = rewards + 0.99 * (~dones).float() * net(next_states).max(1).values
        q = net(states).gather(1, actions.long().reshape(-1, 1)).squeeze(1)
        loss = torch.nn.functional.mse_loss(q, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    block = LOOP_STEPS // LOOP_BLOCKS

    def timed_block(fn: Callable[[], Any]) -> float:
        # A full collection first: a block is short (about a second), and one collection of
        # the old generation (about 0.4 s with TensorFlow and torch loaded), set off by another
        # path's setup garbage, would otherwise land in whichever block runs next.
        gc.collect()
        return timed(fn)

    def ring() -> float:
        capacity = LOOP_WARMUP + block
        s = np.zeros((capacity, 4), np.float32)
        a = np.zeros(capacity, np.int64)
        r = np.zeros(capacity, np.float32)
        s2 = np.zeros((capacity, 4), np.float32)
        d = np.zeros(capacity, bool)

        def step(i: int) -> None:
            s[i], a[i], r[i], s2[i], d[i] = observations[i], i % 2, 1.0, observations[i + 1], False
            idx = rng.integers(0, i + 1, LOOP_BATCH)
            learn(*(torch.from_numpy(x[idx]) for x in (s, a, r, s2, d)))

        for i in range(LOOP_WARMUP):
            step(i)
        return timed_block(lambda: [step(i) for i in range(LOOP_WARMUP, LOOP_WARMUP + block)])

    def ours(backend: str, layout: str = "auto") -> float:
        directory = tempfile.mkdtemp(prefix=f"loop_{backend}_", dir=root)
        if backend == "from_spaces":  # what a user gets without naming a backend or layout
            import gymnasium

            made = ReplayBufferManager.from_spaces(
                gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                gymnasium.spaces.Discrete(2),
                capacity=LOOP_WARMUP + block,
                checkpoint_dir=directory,
            )
        else:
            made = ReplayBufferManager(
                spec,
                LOOP_WARMUP + block,
                directory,
                SEQUENCE_LENGTH,
                backend=backend,
                layout=layout,
            )
        with made as manager:
            manager.create_replay_buffer()
            writer = manager.transition_writer()
            for i in range(LOOP_BATCH):
                writer.add(observations[i], i % 2, 1.0, observations[i + 1], False, False)
            with manager.torch_batches(LOOP_BATCH, transitions=True) as batches:

                def step(i: int) -> None:
                    writer.add(observations[i], i % 2, 1.0, observations[i + 1], False, False)
                    b = next(batches)
                    learn(b.states, b.actions, b.rewards, b.next_states, b.dones)

                for i in range(LOOP_BATCH, LOOP_WARMUP):
                    step(i)
                return timed_block(
                    lambda: [step(i) for i in range(LOOP_WARMUP, LOOP_WARMUP + block)]
                )

    paths = {
        "numpy ring buffer": ring,
        "ours from_spaces defaults": lambda: ours("from_spaces"),
        f"ours reverb defaults ({DEFAULT_LAYOUT})": lambda: ours("reverb"),
        "ours reverb, nested layout": lambda: ours("reverb", "nested"),
        "ours local": lambda: ours("local"),
    }
    rows: list[Row] = []
    default_threads = torch.get_num_threads()
    # torch's default (one intra-op thread per core) and one thread, the setting for a small
    # model on a machine whose other cores sample: the same for the ring buffer and ours.
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        seconds = dict.fromkeys(paths, 0.0)
        for _ in range(LOOP_BLOCKS):
            for name, run in paths.items():
                seconds[name] += run()
        per_step = 1e6 / (block * LOOP_BLOCKS)
        suffix = f", torch threads {threads}"
        rows += [
            Row(
                "loop",
                "train",
                name + suffix,
                value * per_step,
                "us/step",
                None if name == "numpy ring buffer" else "numpy ring buffer" + suffix,
            )
            for name, value in seconds.items()
        ]
    torch.set_num_threads(default_threads)
    return rows


# ---------------------------------------------------------------------------------------- run


def run_workload(workload: Workload, batches: int, backends: list[str]) -> list[Row]:
    steps = workload.trajectories()
    root = tempfile.mkdtemp(prefix=f"replay_bench_{workload.name}_")
    rows: list[Row] = []
    if "reverb" in backends:
        rows += reverb_rows(workload, steps, batches, root)
    if "local" in backends:
        if "reverb" not in backends:  # the insert anchor
            rows += anchor_rows(workload, steps, root)
        rows += local_rows(workload, steps, batches, root)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def anchor_rows(workload: Workload, steps: list[Any], root: str) -> list[Row]:
    manager = ReplayBufferManager(workload.spec(), 2 * workload.steps, os.path.join(root, "a"))
    with manager:
        manager.create_replay_buffer()
        seconds = insert_tf_agents(manager, steps)
    return [Row(workload.name, "insert", "tf-agents observer", len(steps) / seconds, "steps/s")]


def fresh_process_memory(
    workload: Workload, backend: str, layout: str, length: int = SEQUENCE_LENGTH
) -> list[int]:
    """`measure_memory` run in a new process, on `--memory_scale` times `workload`'s steps:
    the RSS readings of `insert_with`, then the steps written and the items stored."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--measure_memory={workload.name}:{backend}:{layout}:{length}",
        f"--steps={_STEPS.value * _MEMORY_SCALE.value}",
        f"--image_steps={_IMAGE_STEPS.value * _MEMORY_SCALE.value}",
        f"--episode={EPISODE}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RSS ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def measure_memory(
    workload: Workload, backend: str, layout: str, length: int = SEQUENCE_LENGTH
) -> list[int]:
    """The RSS readings of one observer filling a fresh buffer of items of `length` steps
    (`insert_with`), then the RSS before the buffer was created, the steps written and the
    items the buffer holds. Layout "tf-agents" fills a nested table with TF-Agents'
    observer."""
    steps = workload.trajectories()
    with tempfile.TemporaryDirectory(prefix="replay_bench_memory_") as root:
        # Modules a first buffer imports and caches it fills are loaded by a small one first,
        # so that the reading before the measured buffer is created holds none of them.
        with ReplayBufferManager(
            workload.spec(),
            10,
            os.path.join(root, "warm"),
            SEQUENCE_LENGTH,
            backend=backend,
            layout="nested" if layout == "tf-agents" else layout,
        ) as warm:
            warm.create_replay_buffer()
            insert_ours(warm, steps[:20])
        gc.collect()
        before = rss_bytes()
        manager = ReplayBufferManager(
            workload.spec(),
            # The local backend's per-item arrays are allocated with the table: filled to its
            # capacity, its RSS per item counts each of them once.
            len(steps) if backend == "local" else 2 * workload.steps,
            os.path.join(root, "ckpt"),
            length,
            timeouts=Timeouts(sample=120),
            backend=backend,
            layout="nested" if layout == "tf-agents" else layout,
        )
        with manager:
            manager.create_replay_buffer()
            rss: list[int] = []
            if layout == "tf-agents":
                observer = reverb_utils.ReverbAddTrajectoryObserver(
                    manager.py_client, manager.table_name, length
                )
                insert_with(observer, steps, rss)
                observer.close()
            else:
                insert_ours(manager, steps, rss)
            return [*rss, before, len(steps), manager.num_frames()]


def memory_per_step(rss: list[int]) -> tuple[float, float]:
    """From `fresh_process_memory`'s readings: the RSS growth per step (the least-squares
    slope over the readings after the first `MEMORY_SKIP` parts: what each further step
    costs) and the growth over all steps divided by them (that plus the fixed costs)."""
    readings, steps = rss[:-3], rss[-2]
    bounds = memory_bounds(steps)
    slope = float(np.polyfit(bounds[MEMORY_SKIP:], readings[MEMORY_SKIP:], 1)[0])
    return slope, (readings[-1] - readings[0]) / steps


def memory_rows(workload: str, rss: list[int], tag: str) -> list[Row]:
    """The server's memory per stored step (`memory_per_step`), as two rows."""
    marginal, total = memory_per_step(rss)
    return [
        Row(workload, "memory", f"server RSS per stored step{tag}", marginal, "B", _RAW),
        Row(workload, "memory", f"  same, incl. fixed cost{tag}", total, "B", _RAW),
    ]


def reverb_rows(workload: Workload, steps: list[Any], batches: int, root: str) -> list[Row]:
    """Our inserts, memory, sampling and checkpoints per layout (our rows of layouts other than
    "nested" get a `[layout]` suffix), and the anchors on a nested table."""
    spec = workload.spec()
    rows: list[Row] = []
    ours = {
        "ours observer": insert_ours,
        "ours TransitionWriter.add": insert_transition_writer,
        f"ours add_multi ({NUM_ENVS} envs)": insert_add_multi,
    }
    anchors = {
        "tf-agents observer": insert_tf_agents,
        "raw TrajectoryWriter": insert_trajectory_writer,
        "raw StructuredWriter": insert_structured_writer,
        f"tf-agents observers ({NUM_ENVS} envs)": insert_tf_agents_envs,
    }
    managers = {}
    for layout in _LAYOUTS.value:
        tag = layout_tag(layout)
        manager = ReplayBufferManager(
            spec,
            2 * workload.steps,
            os.path.join(root, f"ckpt_{layout}"),
            SEQUENCE_LENGTH,
            timeouts=Timeouts(sample=120),
            layout=layout,
        )
        manager.create_replay_buffer()
        managers[layout] = manager
        # Ours first: the memory figure needs a fresh server (later runs reuse freed memory).
        for name, insert in ours.items():
            manager.clear()
            rate = len(steps) / insert(manager, steps)
            rows.append(
                Row(workload.name, "insert", name + tag, rate, "steps/s", "tf-agents observer")
            )
        rows += memory_rows(workload.name, fresh_process_memory(workload, "reverb", layout), tag)
    tf_agents = memory_per_step(fresh_process_memory(workload, "reverb", "tf-agents"))[0]
    rows.append(
        Row(workload.name, "memory", "tf-agents observer RSS per step", tf_agents, "B", _RAW)
    )
    raw = np.prod(workload.observation_shape) * np.dtype(workload.observation_dtype).itemsize
    rows.append(Row(workload.name, "memory", _RAW, float(raw), "B"))
    anchor_manager = managers.get("nested")
    if anchor_manager is None:
        anchor_manager = ReplayBufferManager(
            spec,
            2 * workload.steps,
            os.path.join(root, "ckpt_anchor"),
            SEQUENCE_LENGTH,
            timeouts=Timeouts(sample=120),
            layout="nested",  # the anchors write and read a nested table (the default is packed)
        )
        anchor_manager.create_replay_buffer()
    for name, insert in anchors.items():
        anchor_manager.clear()
        seconds = insert(anchor_manager, steps)
        rows.append(Row(workload.name, "insert", name, len(steps) / seconds, "steps/s"))
    # add_multi also against the same work done the TF-Agents way: one observer per env.
    for layout in _LAYOUTS.value:
        tag = layout_tag(layout)
        multi = next(r for r in rows if r.path == f"ours add_multi ({NUM_ENVS} envs){tag}")
        rows.append(
            dataclasses.replace(
                multi,
                path=f"  same, vs {NUM_ENVS} tf-agents obs.{tag}",
                anchor=f"tf-agents observers ({NUM_ENVS} envs)",
            )
        )
    if "nested" not in managers:
        # The anchors' sampling, on the nested table the anchor inserts filled.
        anchor_manager.clear()
        insert_ours(anchor_manager, steps)
        rows += sample_rows(workload.name, anchor_manager, batches)
        anchor_manager.close()
    for layout, manager in managers.items():
        tag = layout_tag(layout)
        manager.clear()  # the table holds what the observer writes, in every layout
        insert_ours(manager, steps)
        rows += sample_rows(workload.name, manager, batches, tag)
        rows += checkpoint_rows(workload.name, manager, spec, tag)
    rows += sharded_rows(workload, steps, batches, root)
    return rows


def median_rows(runs: list[list[Row]]) -> list[Row]:
    """Every row of the first run with the median value of all runs."""
    values: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for row in run:
            values.setdefault((row.workload, row.path), []).append(row.value)
    return [
        dataclasses.replace(row, value=float(np.median(values[(row.workload, row.path)])))
        for row in runs[0]
    ]


def print_table(rows: list[Row]) -> None:
    values = {(r.workload, r.path): r.value for r in rows}
    print(f"{'workload':9} {'metric':7} {'path':38} {'value':>14}  {'ratio':>7}  vs")
    for r in rows:
        ratio = ""
        if r.anchor and values.get((r.workload, r.anchor)):
            ratio = f"{r.value / values[(r.workload, r.anchor)]:.2f}x"
        value = f"{r.value:>10,.2f}" if r.unit == "%" else f"{r.value:>10,.0f}"
        print(
            f"{r.workload:9} {r.metric:7} {r.path:38} {value} {r.unit:>5}  {ratio:>7}"
            f"  {r.anchor or ''}"
        )


# Steps of the untimed `learn` of each buffer before the timed ones (past DQN's default
# `learning_starts`, so that training runs too).
SB3_WARMUP_STEPS = 1_000
# Steps of each timed `learn` call: the two buffers' models learn by turns in calls of this
# many steps (who goes first alternating), so that a load that drifts during the run weighs on
# both alike. One whole `learn` per buffer moved by up to 13% from one round to the next.
SB3_TURN_STEPS = 1_500


def sb3_rows(steps: int, ours_first: bool) -> list[Row]:
    """SB3's DQN `learn` on CartPole-v1 (default hyperparameters, seed 0, one torch thread)
    with `ReverbReplayBuffer(backend="local")` and with SB3's `ReplayBuffer`: after an untimed
    `learn(SB3_WARMUP_STEPS)` of each, both models learn `steps` steps in `learn` calls of
    `SB3_TURN_STEPS` taken by turns (`ours_first`: ours first in the first turn); env steps per
    second (and per CPU second of this process) of each."""
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.buffers import ReplayBuffer

    from replay_service.integrations.sb3 import ReverbReplayBuffer

    torch.set_num_threads(1)

    def model(buffer_class: type, kwargs: dict[str, Any] | None) -> Any:
        return DQN(
            "MlpPolicy",
            "CartPole-v1",
            replay_buffer_class=buffer_class,
            replay_buffer_kwargs=kwargs,
            seed=0,
            device="cpu",
        )

    runs = [
        ("ReverbReplayBuffer [local]", ReverbReplayBuffer, {"backend": "local"}),
        ("SB3 ReplayBuffer", ReplayBuffer, None),
    ]
    models = {path: model(cls, kwargs) for path, cls, kwargs in runs}
    # Untimed first: the first `learn` of a process pays for lazy imports and torch's first
    # calls (about a second), which would fall on whichever buffer is timed first.
    for learner in models.values():
        learner.learn(SB3_WARMUP_STEPS)
    seconds = dict.fromkeys(models, 0.0)
    cpu_seconds = dict.fromkeys(models, 0.0)
    order = list(models)[:: 1 if ours_first else -1]
    done = 0
    while done < steps:
        turn = min(SB3_TURN_STEPS, steps - done)
        for path in order:
            learner = models[path]
            gc.collect()
            cpu = time.process_time()
            seconds[path] += timed(
                lambda dqn=learner, n=turn: dqn.learn(n, reset_num_timesteps=False)
            )
            cpu_seconds[path] += time.process_time() - cpu
        order.reverse()
        done += turn
    for learner in models.values():
        if isinstance(learner.replay_buffer, ReverbReplayBuffer):
            learner.replay_buffer.close()
    ours, theirs = (path for path, _, _ in runs)
    # Steps per CPU second of this process too: on a machine shared with other work, the wall
    # clock also counts the time other processes held the cores.
    return [
        Row("sb3", "learn", ours, steps / seconds[ours], "st/s", theirs),
        Row("sb3", "learn", theirs, steps / seconds[theirs], "st/s"),
        Row("sb3", "learn", f"{ours} (cpu)", steps / cpu_seconds[ours], "st/s", f"{theirs} (cpu)"),
        Row("sb3", "learn", f"{theirs} (cpu)", steps / cpu_seconds[theirs], "st/s"),
    ]


def extra_rows(names: list[str]) -> list[Row]:
    """The rows of the atari and sizes workloads (scripts/bench_atari.py, bench_sizes.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rows: list[Row] = []
    if "atari" in names:
        import bench_atari

        rows += [
            Row(*r)
            for r in bench_atari.atari_rows(
                _ATARI_ENVS.value,
                _ATARI_STEPS.value,
                _ATARI_CAPACITY.value,
                _ATARI_BATCHES.value,
                _ATARI_SEED.value,
                _ATARI_CACHE.value,
            )
        ]
    if "sizes" in names:
        import bench_sizes

        sizes = [int(size) for size in _SIZES.value]
        rows += [Row(*r) for r in bench_sizes.sizes_rows(sizes, _SIZES_BATCHES.value)]
    return rows


def main(argv: list[str]) -> None:
    """Runs every workload and prints (and optionally saves) the table."""
    del argv
    workloads = {
        "cartpole": Workload("cartpole", (4,), "float32", _STEPS.value),
        "image": Workload("image", (84, 84, 4), "uint8", _IMAGE_STEPS.value),
    }
    extra = {"loop", "sharded", "atari", "sizes", "sb3"}
    unknown = sorted(set(_WORKLOADS.value) - set(workloads) - extra)
    if unknown:
        raise app.UsageError(f"unknown workloads {unknown}; choose from {sorted(workloads)}")
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    unknown = sorted(set(_BACKENDS.value) - {"reverb", "local"})
    if unknown or _REPEATS.value < 1:
        raise app.UsageError(f"backends are reverb/local (got {unknown}), repeats >= 1")
    global EPISODE
    EPISODE = _EPISODE.value
    if _MEASURE_MEMORY.value:
        name, backend, layout, length = _MEASURE_MEMORY.value.split(":")
        print("RSS " + json.dumps(measure_memory(workloads[name], backend, layout, int(length))))
        return
    runs = []
    for repeat in range(_REPEATS.value):
        run = [
            row
            for name in _WORKLOADS.value
            if name in workloads
            for row in run_workload(workloads[name], _BATCHES.value, _BACKENDS.value)
        ]
        if "sharded" in _WORKLOADS.value:  # the sharded row alone, on CartPole steps
            root = tempfile.mkdtemp(prefix="replay_bench_sharded_")
            cartpole = workloads["cartpole"]
            run += sharded_rows(cartpole, cartpole.trajectories(), _BATCHES.value, root)
            shutil.rmtree(root, ignore_errors=True)
        if "loop" in _WORKLOADS.value:
            root = tempfile.mkdtemp(prefix="replay_bench_loop_")
            run += loop_rows(root)
            shutil.rmtree(root, ignore_errors=True)
        run += extra_rows(_WORKLOADS.value)
        if "sb3" in _WORKLOADS.value:
            run += sb3_rows(_SB3_STEPS.value, ours_first=repeat % 2 == 0)
        runs.append(run)
    rows = median_rows(runs)
    print(f"median of {_REPEATS.value} runs")
    print_table(rows)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    app.run(main)
