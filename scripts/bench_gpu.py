"""Atari frame stacks sampled on a GPU: ours against TorchRL's `LazyTensorStorage(device=...)`.

    python scripts/bench_gpu.py --run BreakoutNoFrameskip-v4_40000_0.npz --sizes 32,256

The run is a cached env run of `scripts/bench_atari.py` (real ALE frames; any npz holding the
same arrays, compressed or not). Each buffer is filled with every transition of the run by
single adds, as a collector adds them, then sampled in batches of `--batches` sizes as torch
tensors on the device (states, actions, rewards, next states, dones):

- `ours frame_stack=4 device=cuda`: `from_spaces(..., frame_stack=4, device="cuda")`, each
  frame stored once in the GPU's memory and the stacks gathered there;
- `ours frame_stack=4 (host ring)`: the same on the host, `torch_batches(..., device="cuda")`
  copying each batch over;
- `torchrl LazyTensorStorage device=cuda`: TorchRL's `ReplayBuffer(LazyTensorStorage(capacity,
  device="cuda"))`, one TensorDict of whole stacks per transition.

Printed per buffer: device bytes per stored transition (`torch.cuda.memory_allocated` after the
fill, less before it), inserts per second, batches per second (the device synchronized at the
end of the timed batches) and the fraction of sampled (state, next state) pairs that are real
consecutive pairs of the env run (the first `CHECK_BATCHES` batches, copied to the host).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_atari
from bench_atari import STACK, load_run, spaces, stack_hash

CHECK_BATCHES = 20
WARMUP_BATCHES = 10
OURS_DEVICE = "ours frame_stack=4 device=cuda"
OURS_HOST = "ours frame_stack=4 (host ring)"
TORCHRL = "torchrl LazyTensorStorage device=cuda"


class GpuBuffer:
    """One buffer as a user drives it: `add` a transition, `batches(size)` on the device."""

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Waits until every add is stored."""

    def batches(self, size: int) -> Iterator[tuple[Any, ...]]:
        raise NotImplementedError

    def close(self) -> None:
        """Frees what the buffer holds."""


class Ours(GpuBuffer):
    """`from_spaces(..., frame_stack=4, device=storage)`, a transition writer and
    `torch_batches(size, transitions=True, device=device)`."""

    def __init__(self, capacity: int, n_actions: int, storage: str | None, device: str) -> None:
        from replay_service import ReplayBufferManager

        self._dir = tempfile.mkdtemp(prefix="replay_bench_gpu_")
        options: dict[str, Any] = {"frame_stack": STACK}
        if storage is not None:
            options["device"] = storage
        self.manager = ReplayBufferManager.from_spaces(
            *spaces(n_actions),
            capacity=capacity,
            checkpoint_dir=os.path.join(self._dir, "replay"),
            **options,
        )
        self.manager.create_replay_buffer()
        self.writer = self.manager.transition_writer()
        self._device = device

    def add(self, s: Any, a: int, r: float, ns: Any, term: bool, trunc: bool) -> None:
        self.writer.add(s, a, r, ns, term, trunc)

    def flush(self) -> None:
        self.writer.flush()

    def batches(self, size: int) -> Iterator[tuple[Any, ...]]:
        with self.manager.torch_batches(size, transitions=True, device=self._device) as stream:
            for b in stream:
                yield b.states, b.actions, b.rewards, b.next_states, b.dones

    def close(self) -> None:
        self.writer.close()
        self.manager.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class TorchRL(bench_atari.TorchRL, GpuBuffer):
    """TorchRL's `ReplayBuffer(LazyTensorStorage(capacity, device=device))`, one TensorDict of
    whole stacks per transition (`bench_atari.TorchRL` on a device), sampled `size` at a time."""

    def __init__(self, capacity: int, device: str) -> None:
        super().__init__(capacity, device=device, batch_size=None)

    def batches(self, size: int) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        while True:
            b = self.buffer.sample(size)
            yield b["obs"], b["action"], b["reward"], b["next_obs"], b["done"]


def measure(
    make: Callable[[], GpuBuffer],
    data: dict[str, np.ndarray],
    capacity: int,
    sizes: list[int],
    batches: int,
    profile: int = 0,
) -> dict[str, Any]:
    """Fills the buffer `make()` returns with the run `data` and samples it.

    Returns:
      device_b (device bytes per stored transition), insert (steps/s), sample_<size>
      (batches/s) and correct_<size> (fraction of checked pairs that are real) per size.
    """
    import torch

    frames, sidx, nidx = data["frames"], data["state_idx"], data["next_idx"]
    acts, rews = data["actions"], data["rewards"]
    terms, truncs = data["terminated"], data["truncated"]
    pairs = set(zip(data["state_hash"].tolist(), data["next_hash"].tolist(), strict=True))
    steps = len(acts)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    gc.collect()
    sync()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    buffer = make()
    start = time.perf_counter()
    for t in range(steps):
        buffer.add(
            frames[sidx[t]], int(acts[t]), float(rews[t]), frames[nidx[t]], terms[t], truncs[t]
        )
    buffer.flush()
    sync()
    insert_s = time.perf_counter() - start
    stored = min(steps, capacity)
    after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    result: dict[str, Any] = {"device_b": (after - before) / stored, "insert": steps / insert_s}
    for size in sizes:
        iterator = buffer.batches(size)
        good = total = 0
        for _ in range(CHECK_BATCHES):
            states, _, _, next_states, _ = next(iterator)
            for s, ns in zip(states.cpu().numpy(), next_states.cpu().numpy(), strict=True):
                good += (stack_hash(s), stack_hash(ns)) in pairs
                total += 1
        for _ in range(WARMUP_BATCHES):
            next(iterator)
        sync()
        start = time.perf_counter()
        for _ in range(batches):
            batch = next(iterator)
        sync()
        result[f"sample_{size}"] = batches / (time.perf_counter() - start)
        if profile and size == sizes[0]:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(profile):
                next(iterator)
            sync()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        result[f"correct_{size}"] = good / total
        result[f"device_{size}"] = str(batch[0].device)
        iterator.close()
    buffer.close()
    del buffer
    gc.collect()
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="A cached env run (npz) of bench_atari.py.")
    parser.add_argument("--capacity", type=int, default=0, help="0: the run's steps.")
    parser.add_argument("--batches", type=int, default=500, help="Timed batches per size.")
    parser.add_argument("--sizes", default="32,256", help="Batch sizes, commas.")
    parser.add_argument("--device", default="cuda", help="The torch device (cpu: a dry run).")
    parser.add_argument(
        "--buffers", default=",".join([OURS_DEVICE, OURS_HOST, TORCHRL]), help="Commas."
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="Batches of the first size profiled per buffer."
    )
    args = parser.parse_args(argv)
    import torch

    data = load_run(os.path.expanduser(args.run))
    steps = len(data["actions"])
    capacity = args.capacity or steps
    n_actions = int(data["n_actions"])
    sizes = [int(s) for s in args.sizes.split(",")]
    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{name}; torch {torch.__version__}; {steps} steps, capacity {capacity}", flush=True)
    makers: dict[str, Callable[[], GpuBuffer]] = {
        OURS_DEVICE: lambda: Ours(capacity, n_actions, device, device),
        OURS_HOST: lambda: Ours(capacity, n_actions, None, device),
        TORCHRL: lambda: TorchRL(capacity, device),
    }
    results: dict[str, dict[str, Any]] = {}
    for buffer in args.buffers.split(","):
        try:
            results[buffer] = measure(
                makers[buffer], data, capacity, sizes, args.batches, args.profile
            )
        except Exception as e:  # an anchor that cannot run here: say why, go on
            print(f"{buffer}: not measured ({type(e).__name__}: {e})", flush=True)
            continue
        print(buffer, results[buffer], flush=True)
    anchor = results.get(TORCHRL)
    print(f"\n{'buffer':40} {'device B/step':>13} {'insert/s':>9}", end="")
    for size in sizes:
        print(f" {'b/s @' + str(size):>10} {'ratio':>6} {'correct':>8}", end="")
    print()
    for buffer, r in results.items():
        print(f"{buffer:40} {r['device_b']:>13,.0f} {r['insert']:>9,.0f}", end="")
        for size in sizes:
            ratio = r[f"sample_{size}"] / anchor[f"sample_{size}"] if anchor else float("nan")
            print(
                f" {r[f'sample_{size}']:>10,.0f} {ratio:>5.2f}x {r[f'correct_{size}']:>8.2%}",
                end="",
            )
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
