"""Codecs for stored frames: bytes per frame, encode speed and batch-decode speed on real Atari
frames, and the resident memory of a `CompressedColumn` holding them.

    .venv/bin/python scripts/codec_benchmark.py [--games=Breakout,Pong] [--steps=5000]

Frames: `steps` 84x84 uint8 observations per game from gymnasium's
`AtariPreprocessing(gym.make("<game>NoFrameskip-v4"), frame_skip=4, noop_max=0)` under a seeded
random policy (ale-py; cached as .npy under `--frames_dir`). Per codec it prints the mean bytes
per frame, frames encoded per second one call per frame (as a writer adds steps), and batches
per second of `CompressedColumn.read` of 32x5 random frames into one preallocated array on 1
and on `--threads` threads (one thread: this thread's CPU time, which a loaded machine does not
stretch; several: wall time; each the fastest of many short runs); then, in a fresh process
per codec, the RSS growth per stored frame of a column of `--rss_frames` slots filled once and
once more (a ring overwriting itself).
Codecs whose library is not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from replay_service.backends.local.codecs import (
    CODECS,
    Codec,
    CompressedColumn,
    codec,
)
from replay_service.errors import ConfigError

BATCH = 32 * 5


class ZstdLevel(Codec):
    """zstd at another level, or with a dictionary trained on the first frames."""

    name = "zstd-variant"

    def __init__(self, level: int, dictionary: bytes | None = None) -> None:
        import zstandard

        self._zstd = zstandard
        data = zstandard.ZstdCompressionDict(dictionary) if dictionary else None
        self._c = zstandard.ZstdCompressor(level=level, dict_data=data, write_content_size=True)
        self._d = zstandard.ZstdDecompressor(dict_data=data)

    def encode(self, value: np.ndarray) -> bytes:
        return bytes(memoryview(self._c.compress(value)))

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        decoded = self._d.multi_decompress_to_buffer(list(payloads), threads=1)
        for index in range(len(payloads)):
            out[index * size : (index + 1) * size] = decoded[index]


class ZstdLoop(ZstdLevel):
    """zstd level 1 decoded one `decompress` call per payload (against the batch call)."""

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        decompress = self._zstd.ZstdDecompressor().decompress
        for index, payload in enumerate(payloads):
            out[index * size : (index + 1) * size] = decompress(payload)


class ZstdInternalThreads(ZstdLevel):
    """zstd level 1, the batch call's own threads (`multi_decompress_to_buffer(threads=2)`)."""

    def decode_batch(self, payloads: Sequence[bytes], out: np.ndarray, threads: int = 1) -> None:
        flat = memoryview(out.reshape(-1).view(np.uint8))
        size = out.nbytes // len(payloads)
        decoded = self._d.multi_decompress_to_buffer(list(payloads), threads=threads)
        for index in range(len(payloads)):
            flat[index * size : (index + 1) * size] = decoded[index]


class Lz4Variant(Codec):
    """lz4 block at high compression, or lz4 frames."""

    name = "lz4-variant"

    def __init__(self, kind: str) -> None:
        import lz4.block
        import lz4.frame

        self._kind = kind
        self._block, self._frame = lz4.block, lz4.frame

    def encode(self, value: np.ndarray) -> bytes:
        if self._kind == "frame":
            return self._frame.compress(value)
        return self._block.compress(value, mode="high_compression", compression=9, store_size=False)

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        for index, payload in enumerate(payloads):
            if self._kind == "frame":
                raw = self._frame.decompress(payload)
            else:
                raw = self._block.decompress(payload, uncompressed_size=size)
            out[index * size : (index + 1) * size] = raw


class Zlib(Codec):
    """zlib level 1 (the standard library; releases the GIL per call)."""

    name = "zlib-1"

    def encode(self, value: np.ndarray) -> bytes:
        return zlib.compress(value, 1)

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        for index, payload in enumerate(payloads):
            out[index * size : (index + 1) * size] = zlib.decompress(payload)


def candidates(frames: np.ndarray) -> list[tuple[str, Callable[[], Codec]]]:
    """The codecs measured, by label (a library missing: a note, and the codec skipped)."""
    out: list[tuple[str, Callable[[], Codec]]] = [("none (raw)", lambda: codec("none"))]
    try:
        import zstandard

        sample = [f.tobytes() for f in frames[:: max(1, len(frames) // 1000)]]
        dictionary = zstandard.train_dictionary(16384, sample).as_bytes()
        out += [
            ("zstd-1", lambda: codec("zstd")),
            ("zstd-3", lambda: ZstdLevel(3)),
            ("zstd-1 + 16 KB dictionary", lambda: ZstdLevel(1, dictionary)),
            ("zstd-1, one decompress per frame", lambda: ZstdLoop(1)),
            ("zstd-1, batch call's own threads", lambda: ZstdInternalThreads(1)),
        ]
    except ImportError:
        print("zstandard not installed: zstd skipped")
    try:
        import lz4.block  # noqa: F401

        out += [
            ("lz4 block (recommended)", lambda: codec("lz4")),
            ("lz4 block HC-9", lambda: Lz4Variant("hc")),
            ("lz4 frame", lambda: Lz4Variant("frame")),
        ]
    except ImportError:
        print("lz4 not installed: lz4 skipped")
    out.append(("zlib-1", Zlib))
    for missing in ("blosc2", "numcodecs", "brotli", "snappy", "isal", "cramjam"):
        try:
            __import__(missing)
            print(f"{missing} is installed but not measured")
        except ImportError:
            print(f"{missing} not installed: skipped")
    return out


def frames_of(game: str, steps: int, directory: str, seed: int = 0) -> np.ndarray:
    """`steps` preprocessed frames of `game` under a seeded random policy (cached)."""
    path = os.path.join(directory, f"{game}-{steps}-{seed}.npy")
    if os.path.exists(path):
        return np.load(path)
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)
    env = AtariPreprocessing(gym.make(f"{game}NoFrameskip-v4"), frame_skip=4, noop_max=0)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    frames = [obs]
    while len(frames) < steps:
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        frames.append(obs)
        if terminated or truncated:
            obs, _ = env.reset()
            frames.append(obs)
    env.close()
    stacked = np.stack(frames[:steps])
    os.makedirs(directory, exist_ok=True)
    np.save(path, stacked)
    return stacked


def rate(
    run: Callable[[], None],
    seconds: float,
    calls: int = 5,
    clock: Callable[[], float] = time.thread_time,
) -> float:
    """Calls of `run` per second of `clock`: the fastest of runs of `calls` calls over about
    `seconds` of wall time, after one warm-up call. The default clock is this thread's CPU
    time, which other processes on a loaded machine do not stretch (right for work done in
    this thread); work spread over threads needs the wall clock (`time.perf_counter`), and the
    fastest run is then the one other processes disturbed least."""
    run()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        begin = clock()
        for _ in range(calls):
            run()
        best = min(best, clock() - begin)
    return calls / max(best, 1e-9)


def measure(label: str, make: Callable[[], Codec], frames: np.ndarray, args: argparse.Namespace):
    """One row: bytes per frame, encode frames/s, read batches/s on 1 and `threads` threads."""
    column = CompressedColumn(len(frames), frames.shape[1:], frames.dtype, make())
    encode = rate(lambda: column.encode(frames[:100]), args.seconds, calls=1) * 100
    payloads = column.encode(frames)
    column.store(np.arange(len(frames)), payloads)
    rng = np.random.default_rng(1)
    out = np.empty((BATCH, *frames.shape[1:]), frames.dtype)
    check = rng.integers(0, len(frames), BATCH)
    assert np.array_equal(column.read(check, out, threads=args.threads), frames[check]), label
    batches = [rng.integers(0, len(frames), BATCH) for _ in range(64)]
    reads = {}
    for threads in (1, args.threads):
        turn = iter(range(1 << 62))

        def read(threads: int = threads, turn: Iterator[int] = turn) -> None:
            column.read(batches[next(turn) % 64], out, threads=threads)

        clock = time.thread_time if threads == 1 else time.perf_counter
        reads[threads] = rate(read, args.seconds, clock=clock)
    return column.payload_bytes / len(frames), encode, reads[1], reads[args.threads]


def numpy_take(frames: np.ndarray) -> Callable[[], None]:
    """One batch of the uncompressed ring's read (`column.take(positions, axis=0)`, as
    `StepRing._read_slots` gathers), per call."""
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, len(frames), BATCH) for _ in range(64)]
    turn = iter(range(1 << 62))

    def take() -> None:
        frames.take(batches[next(turn) % 64], axis=0)

    return take


def rss_row(name: str, game: str, args: argparse.Namespace) -> tuple[float, float]:
    """RSS growth per stored frame of a column of `rss_frames` slots filled once, then once
    more by other frames, in a fresh process."""
    command = [sys.executable, os.path.abspath(__file__), "--rss_child", f"{name}:{game}"]
    command += [f"--steps={args.steps}", f"--frames_dir={args.frames_dir}"]
    command += [f"--rss_frames={args.rss_frames}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()
    return float(out[-2]), float(out[-1])


def rss_child(spec: str, args: argparse.Namespace) -> None:
    """The child of `rss_row`: prints the bytes per frame after the first and second fill."""
    name, game = spec.split(":")
    frames = frames_of(game, args.steps, args.frames_dir)
    column = CompressedColumn(args.rss_frames, frames.shape[1:], frames.dtype, name)
    order = np.random.default_rng(2).permutation(args.rss_frames) % len(frames)
    chunk = 1000
    # The values of a write, gathered into one buffer made and touched before the first
    # reading (a temporary array of 7 MB per write would stay in the heap and be counted).
    values = np.empty((chunk, *frames.shape[1:]), frames.dtype)
    values.fill(0)  # its pages committed now

    def fill(offset: int) -> None:
        for start in range(0, args.rss_frames, chunk):
            slots = np.arange(start, min(start + chunk, args.rss_frames))
            # mode="clip": with the default "raise", `take` buffers `out` in a temporary.
            at = (order[slots] + offset) % len(frames)
            np.take(frames, at, 0, values[: len(slots)], mode="clip")
            column.write(slots, values[: len(slots)])

    before = rss()
    fill(0)
    first = rss()
    fill(len(frames) // 3)
    second = rss()
    print((first - before) / args.rss_frames, (second - before) / args.rss_frames)


def rss() -> int:
    """Resident bytes of this process."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", default="Breakout,Pong")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--frames_dir", default="/tmp/replay_codec_frames")
    parser.add_argument("--threads", type=int, default=2, help="Threads of the parallel reads.")
    parser.add_argument("--seconds", type=float, default=1.0, help="Timing of each read row.")
    parser.add_argument("--rss_frames", type=int, default=30_000)
    parser.add_argument("--rss_child", default=None, help="Internal: one RSS measurement.")
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args)
        return
    for game in args.games.split(","):
        frames = frames_of(game, args.steps, args.frames_dir)
        print(f"\n{game}: {len(frames)} frames of {frames[0].nbytes} B, batches of {BATCH}")
        print(
            "| codec | B/frame | ratio | encode frames/s (CPU) | read batches/s, 1 thread "
            f"(CPU) | {args.threads} threads (wall) |"
        )
        print("|---|---|---|---|---|---|")
        take = rate(numpy_take(frames), args.seconds)
        print(f"| uncompressed ring (numpy take) | {frames[0].nbytes:,} | 1.0x | | {take:,.0f} | |")
        for label, make in candidates(frames):
            size, encode, one, many = measure(label, make, frames, args)
            print(
                f"| {label} | {size:,.0f} | {frames[0].nbytes / size:.1f}x | {encode:,.0f} | "
                f"{one:,.0f} | {many:,.0f} |",
                flush=True,
            )
        print(f"\nRSS per stored frame, {args.rss_frames:,} slots (filled once / twice):")
        for name in CODECS:
            try:
                codec(name)
            except ConfigError as error:
                print(f"{name}: skipped ({error})")
                continue
            first, second = rss_row(name, game, args)
            print(f"| {name} | {first:,.0f} B | {second:,.0f} B |", flush=True)


if __name__ == "__main__":
    main()
