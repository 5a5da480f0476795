"""Frames stored once (`frame_stack`): Atari observations of gymnasium's own wrappers on a real
ALE env, written through the users' doors, read back exactly by every sampling call.

Every step of a frame-stacked buffer stores its newest frame only (`specs.frames`);
these tests check that each sampled stack (states and next states) is the one the env gave,
both paddings and both stacking axes, that stacks which are not shifts of the previous one
are refused, and that checkpoints and exports round-trip.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay_service import ConfigError, ReplayBufferManager, SpecMismatchError, Timeouts
from replay_service.backends.local import compressed_column as compressed
from replay_service.config.options import TableConfig
from replay_service.specs import sizes

gym = pytest.importorskip("gymnasium")
ale_py = pytest.importorskip("ale_py")
from gymnasium import spaces

from atari_frames import (
    breakout,
    breakout_manager,
    channels_last,
    check_items,
    fill,
    interleave,
    items,
    laid_out,
    pairs,
    reads,
    recordings,
    stored,
    write,
)

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=2.0, checkpoint=60.0)
FRAME_BYTES = 84 * 84
# Episodes of 1 step and of lengths that are no multiple of 8.
LENGTHS = [1, 3, 5, 9, 2, 12, 1, 16, 7, 8, 1, 4]


@pytest.fixture(scope="module")
def episodes() -> dict[str, list[tuple[Any, ...]]]:
    """Recorded Breakout transitions per padding (`atari_frames.recordings`)."""
    return recordings()


@pytest.fixture()
def make(make_from_spaces) -> Callable[..., ReplayBufferManager]:
    """Local frame-stacked managers of Breakout's spaces (`atari_frames.breakout_manager`)."""
    return functools.partial(breakout_manager, make_from_spaces, "local", timeouts=FAST, seed=0)


def table(manager: ReplayBufferManager) -> Any:
    return manager._backend.client.table(manager.table_name)


@pytest.mark.heavy
@pytest.mark.parametrize(("padding", "axis"), [("reset", 0), ("zero", 0), ("zero", -1)])
def test_every_read_returns_the_envs_stacks(make, episodes, padding: str, axis: int) -> None:
    transitions = laid_out(episodes[padding], axis)
    manager = make(axis=axis)
    truth = fill(manager, transitions)
    seen: set[tuple[bytes, bytes]] = set()
    reads = {
        "torch_batches": manager.torch_batches(64, transitions=True),
        "epoch_batches": manager.epoch_batches(64, transitions=True),
        "recent_batches": manager.recent_batches(64, 3, c_min=10, transitions=True),
        "mixed": manager.mixed_torch_batches(64, {manager.table_name: 1.0}, transitions=True),
    }
    for name, batches in reads.items():
        for count, batch in enumerate(batches):
            got = {
                (s.numpy().tobytes(), n.numpy().tobytes())
                for s, n in zip(batch.states, batch.next_states, strict=True)
            }
            assert got <= truth, name  # 100%: every state and next state the env's
            seen |= got
            if count == 5:
                break
    assert seen == truth  # every stack was read (the epoch covers them all)
    windows = next(iter(manager.torch_batches(32)))
    stacked = windows.observation.numpy()
    assert stacked.shape == (32, 2, *transitions[0][0].shape)
    assert {(w[0].tobytes(), w[1].tobytes()) for w in stacked} <= truth
    dataset = next(iter(manager.torch_dataset(16)))
    assert {(w[0].tobytes(), w[1].tobytes()) for w in dataset.observation.numpy()} <= truth
    # A terminal transition keeps its true next stack (the episode's final observation).
    terminal = [t for t in transitions if t[4]]
    assert {(s.tobytes(), n.tobytes()) for s, _, _, n, _, _ in terminal} <= seen


@pytest.mark.heavy
def test_a_breakout_step_stores_one_frame(make, episodes) -> None:
    manager = make()
    manager.create_replay_buffer()
    write(manager, episodes["reset"])
    stored = table(manager)
    per_step = stored.nbytes / stored.step_capacity
    assert per_step <= 7400 and per_step <= 1.05 * FRAME_BYTES, per_step
    whole = make("whole", frame_stack=None)
    whole.create_replay_buffer()
    write(whole, episodes["reset"][:10])
    assert table(whole).nbytes / table(whole).step_capacity > 4 * FRAME_BYTES


@pytest.mark.heavy
def test_warm_up_writes_the_envs_stacks(make) -> None:
    seen: list[np.ndarray] = []

    class Recorded(gym.Wrapper):
        def reset(self, **kwargs: Any) -> Any:
            observation, info = self.env.reset(**kwargs)
            seen.append(observation)
            return observation, info

        def step(self, action: Any) -> Any:
            result = self.env.step(action)
            seen.append(result[0])
            return result

    manager = make()
    manager.create_replay_buffer()
    assert manager.warm_up(Recorded(breakout("reset")), 120, seed=0, progress=False) == 120
    observations = items(manager)[1]
    recorded = [o.tobytes() for o in seen]
    consecutive = set(itertools.pairwise(recorded))
    assert len(observations) >= 100
    for item in observations:
        assert (item[0].tobytes(), item[1].tobytes()) in consecutive


@pytest.mark.heavy
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_a_caller_reusing_its_stack_arrays_never_changes_what_was_written(
    make, episodes, compression: str | None
) -> None:
    # A vectorised env or a torch loop fills the same observation arrays in place each step;
    # the writer keeps copies (the state of a step within an episode: the copy its continuity
    # check made of the previous next state).
    if compression is not None:
        pytest.importorskip("lz4", reason="the compression extra is not installed")
    transitions = laid_out(episodes["reset"], 0)[:60]
    manager = make(compression=compression)
    manager.create_replay_buffer()
    state = np.empty_like(transitions[0][0])
    next_state = np.empty_like(transitions[0][3])
    with manager.transition_writer() as writer:
        for s, a, r, n, done, cut in transitions:
            state[...] = s
            next_state[...] = n
            writer.add(state, a, r, next_state, done, cut)
            state[...] = 0  # the caller's arrays change before the next add
            next_state[...] = 255
    check_items(manager, transitions)


def test_stacks_that_are_no_shift_are_refused(make, episodes) -> None:
    transitions = episodes["reset"][:6]
    manager = make()
    manager.create_replay_buffer()
    writer = manager.transition_writer(check_continuity=False)
    for transition in transitions[:3]:
        writer.add(*transition)
    before = manager.num_frames()
    state, action, reward, next_state, done, cut = transitions[3]
    wrong = state.copy()
    wrong[1] ^= 1  # frame 1 is not frame 2 of the previous stack
    with pytest.raises(SpecMismatchError, match=r"step 3 of the episode: frame 1"):
        writer.add(wrong, action, reward, next_state, done, cut)
    assert manager.num_frames() == before
    check_items(manager, transitions[:2])

    fresh = make("fresh")
    fresh.create_replay_buffer()
    unpadded = transitions[4][0]  # four different frames: no episode starts with it
    with pytest.raises(SpecMismatchError, match=r"step 0 starts an episode.*not a padded"):
        fresh.transition_writer().add(unpadded, 0, 0.0, transitions[4][3], False, False)
    assert fresh.num_frames() == 0
    assert table(fresh).nbytes == 0 or table(fresh).size == 0


def test_a_next_state_that_is_no_shift_is_refused_as_the_following_state(make, episodes) -> None:
    # Within an episode a state is the previous next state's copy; the stack that does not
    # follow its previous one is refused when it is written as a state, deep in an episode.
    transitions = episodes["reset"][:12]
    assert not any(done or cut for *_, done, cut in transitions)
    manager = make()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for transition in transitions[:10]:
        writer.add(*transition)
    state, action, reward, next_state, done, cut = transitions[10]
    wrong = next_state.copy()
    wrong[1] ^= 1  # frame 1 is not frame 2 of the previous stack
    writer.add(state, action, reward, wrong, done, cut)
    before = manager.num_frames()
    with pytest.raises(SpecMismatchError, match=r"step 11 of the episode: frame 1"):
        writer.add(wrong, *transitions[11][1:])
    assert manager.num_frames() == before
    check_items(manager, transitions[:10])


@pytest.mark.heavy
def test_checkpoint_and_export_round_trip(make, episodes, tmp_path) -> None:
    transitions = episodes["zero"]
    manager = make("source")
    manager.create_replay_buffer()
    write(manager, transitions)
    manager.checkpoint()
    export_dir = tmp_path / "export"
    manager.export(export_dir)
    before = items(manager)
    manager.close()

    loaded = make("source")
    loaded.load_replay_buffer()
    for got, want in zip(items(loaded), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert table(loaded).nbytes / table(loaded).step_capacity <= 1.05 * FRAME_BYTES
    loaded.close()

    imported = make("imported")
    imported.import_buffer(export_dir)
    for got, want in zip(items(imported), before, strict=True):
        np.testing.assert_array_equal(got, want)
    check_items(imported, transitions)

    other = make("source", frame_stack=None)
    with pytest.raises(SpecMismatchError, match=r"frame_stack: requested None.*stored 4"):
        other.load_replay_buffer()


def _spoiled(transitions: list[tuple[Any, ...]], bad: str, at: int) -> list[tuple[Any, ...]]:
    """`transitions` with call `at` given a value of the wrong shape or dtype, a state that
    does not continue the previous call's next state, or (the previous next state spoiled
    alike) a stack that is no shift of the one before."""
    spoiled = list(transitions)
    state, action, reward, next_state, done, cut = spoiled[at]
    if bad == "shape":
        state = state[:3]
    elif bad == "dtype":
        state = state.astype(np.float32)
    elif bad == "continuity":
        state = state.copy()
        state[3, 0, 0] ^= 1
    else:  # "stack"
        state = state.copy()
        state[1] ^= 1
        if at:
            before = spoiled[at - 1]
            spoiled[at - 1] = (*before[:3], state, *before[4:])
    spoiled[at] = (state, action, reward, next_state, done, cut)
    return spoiled


@pytest.mark.parametrize("compression", [None, "lz4"])
@pytest.mark.parametrize("bad", ["shape", "dtype", "continuity", "stack"])
@pytest.mark.parametrize("when", ["first", "later"])
def test_fast_adds_store_and_refuse_what_fully_checked_adds_do(
    make, episodes, bad, when, compression
) -> None:
    """`add`'s fast path (bool flags, after the first call) and its full validation (0/1
    flags: every call) store the same items and raise the same errors, on the first call of
    a writer and later in an episode, with frames stored raw or compressed."""
    transitions = episodes["reset"][:40]
    at = 0
    if when == "later":  # a call whose two calls before are within its episode
        at = next(
            i
            for i in range(3, len(transitions))
            if not any(transitions[j][4] or transitions[j][5] for j in (i - 2, i - 1))
        )
    spoiled = _spoiled(transitions, bad, at)
    results = []
    for fast in (True, False):
        manager = make(f"b{fast}", compression=compression)
        manager.create_replay_buffer()
        errors = []
        with manager.transition_writer() as writer:
            for state, action, reward, next_state, done, cut in spoiled:
                flags = (done, cut) if fast else (int(done), int(cut))
                try:
                    writer.add(state, action, reward, next_state, *flags)
                except SpecMismatchError as e:
                    errors.append(str(e))
        results.append((errors, items(manager), manager.num_frames()))
    (errors, data, frames), (full_errors, full_data, full_frames) = results
    assert errors and errors == full_errors
    assert frames == full_frames
    for fast_field, full_field in zip(data, full_data, strict=True):
        np.testing.assert_array_equal(fast_field, full_field)


def test_windows_inserted_whole_are_checked(make, episodes) -> None:
    transitions = episodes["reset"][:4]
    manager = make()
    manager.create_replay_buffer()
    stacks = np.stack([np.stack([t[0], t[3]]) for t in transitions])
    stacks[2, 1, 0] ^= 1
    data = [np.zeros((4, *f.shape[1:]), f.dtype) for f in items(manager)]
    data[1] = stacks
    with pytest.raises(SpecMismatchError, match=r"item 2, step 1: frame 0"):
        table(manager).insert(data, np.ones(4))
    assert manager.num_frames() == 0


@pytest.mark.heavy
def test_interleaved_writers_and_evictions_keep_every_stack(make, episodes) -> None:
    """Two writers alternate steps and a small table evicts their items: windows are
    rewritten with their earlier frames, and every item still reads back the env's."""
    first, second = episodes["reset"][:80], episodes["zero"][:80]
    manager = make(capacity=7)
    manager.create_replay_buffer()
    writers = [manager.transition_writer(), manager.transition_writer()]
    for a, b in zip(first, second, strict=True):
        writers[0].add(*a)
        writers[1].add(*b)
    truth = pairs(first) | pairs(second)
    observations = items(manager)[1]
    assert len(observations) == 7
    assert {(o[0].tobytes(), o[1].tobytes()) for o in observations} <= truth
    for batch in manager.torch_batches(32, transitions=True):
        got = {
            (s.numpy().tobytes(), n.numpy().tobytes())
            for s, n in zip(batch.states, batch.next_states, strict=True)
        }
        assert got <= truth
        break


@pytest.mark.heavy
@pytest.mark.parametrize("axis", [0, -1])
def test_transition_batches_mixing_zero_final_stacks_read_the_envs_stacks(
    make, episodes, axis: int
) -> None:
    """Episodes whose final observation is unknown (an all-zero next state, as a vector
    collector writes it) beside ordinary ones: in every transition batch each state and next
    state is the one written, those that share frames and the zero ones alike."""
    transitions = [
        (s, a, r, np.zeros_like(n) if index % 2 and (d or t) else n, d, t)
        for index, (s, a, r, n, d, t) in enumerate(episodes["zero"])
    ]
    if axis == -1:
        transitions = channels_last(transitions)
    assert sum(not n.any() for *_, n, _, _ in transitions) >= 1
    manager = make(axis=axis)
    manager.create_replay_buffer()
    write(manager, transitions)
    truth = pairs(transitions)
    seen: set[tuple[bytes, bytes]] = set()
    for count, batch in enumerate(manager.torch_batches(64, transitions=True)):
        got = {
            (s.numpy().tobytes(), n.numpy().tobytes())
            for s, n in zip(batch.states, batch.next_states, strict=True)
        }
        assert got <= truth
        seen |= got
        if count == 30:
            break
    assert {p for p in truth if not np.frombuffer(p[1], np.uint8).any()} <= seen


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frame_stack": 1}, r"frame_stack must be an integer >= 2 or None, got 1"),
        ({"frame_stack": 3}, r"frame_stack=3: the observation's shape \[4, 84, 84\]"),
        ({"frame_stack": 4, "frame_axis": 1}, r"frame_axis must be 0 or -1, got 1"),
        ({"frame_stack": 4, "pad_end_of_episode": True}, r"pad_end_of_episode"),
        ({"frame_stack": None, "frame_axis": -1}, r"frame_axis=-1 needs frame_stack"),
    ],
)
def test_bad_frame_stacks_are_refused(make, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(**options)


@pytest.mark.parametrize(
    ("observation", "backend", "message"),
    [
        (
            spaces.Dict({"pixels": spaces.Box(0, 255, (4, 8, 8), np.uint8)}),
            "local",
            r"frame_stack=4 needs an observation that is one",
        ),
        (
            spaces.Dict({"pixels": spaces.Box(0, 255, (4, 8, 8), np.uint8)}),
            "reverb",
            r"frame_stack=4 needs an observation that is one",
        ),
    ],
)
def test_nested_observations_are_refused_on_both_backends(
    tmp_path, observation: Any, backend: str, message: str
) -> None:
    if backend == "reverb":
        pytest.importorskip("reverb")
    with pytest.raises(ConfigError, match=message):
        ReplayBufferManager.from_spaces(
            observation,
            spaces.Discrete(2),
            capacity=10,
            checkpoint_dir=str(tmp_path),
            backend=backend,
            frame_stack=4,
        )


def test_too_large_a_capacity_is_refused_counting_frames_once(make) -> None:
    with pytest.raises(ConfigError, match=r"frames stored once \(frame_stack=4\)") as error:
        make(capacity=10**9).create_replay_buffer()
    # Counted once: 7056 bytes of frame plus the other fields, not the 28224 of the stack.
    assert "7104 bytes per step" in str(error.value)


FILL = """
import os, sys
import numpy as np
from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

fields = [{"path": "observation", "dtype": "uint8", "shape": [4, 84, 84]},
          {"path": "reward", "dtype": "float32", "shape": []}]
table = LocalTable(TableConfig(capacity=1500, sequence_length=2, frame_stack=4), fields)
streams = [table.stream(), table.stream()]
history = [[], []]
base = rss("VmRSS")
rng = np.random.default_rng(0)
for i in range(1500 * 2):
    w = i % 2
    frame = rng.integers(1, 255, (1, 84, 84), dtype=np.uint8)
    last = history[w][-1][0] if history[w] else np.repeat(frame, 4, axis=0)
    step = [np.concatenate([last[1:], frame]), np.float32(i)]
    history[w] = (history[w] + [step])[-2:]
    if len(history[w]) == 2:
        table.insert_window(history[w], 1.0, streams[w], 1)
peak, now = rss("VmHWM"), rss("VmRSS")
print(table.nbytes, peak - base, now - base, table.step_capacity)
"""


@pytest.mark.slow
def test_filling_grows_the_ring_without_a_second_copy(tmp_path) -> None:
    """Two writers interleave, so the ring grows while it fills: its peak memory stays
    within 1.1x of what it holds at the end (a growth that copied the ring would double it)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FILL)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    nbytes, peak, now, steps = (int(v) for v in result.stdout.split())
    assert steps > 1500 + 4  # it grew
    assert peak <= 1.1 * now, (peak, now, nbytes)


@pytest.mark.heavy
def test_memmap_storage_and_tf_datasets_read_the_envs_stacks(make, episodes) -> None:
    """Memory-mapped files store each frame once as the RAM ring does, and every stack reads
    back (also through `get_dataset`)."""
    transitions = episodes["reset"][:60]
    manager = make(storage="memmap", capacity=40)
    truth = fill(manager, transitions, check=False)
    observations = items(manager)[1]
    assert len(observations) == 40
    assert {(o[0].tobytes(), o[1].tobytes()) for o in observations} <= truth
    trajectory, _ = next(iter(manager.get_dataset(8)))
    got = trajectory.observation.numpy()
    assert got.shape == (8, 2, 4, 84, 84)
    assert {(o[0].tobytes(), o[1].tobytes()) for o in got} <= truth


@pytest.mark.heavy
@pytest.mark.parametrize(
    "device",
    [
        "cpu",  # the device code path (torch tensors gathered by index) on the host
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here"),
        ),
    ],
)
@pytest.mark.parametrize(("padding", "axis"), [("reset", 0), ("zero", 0), ("zero", -1)])
def test_a_ring_on_a_device_gathers_every_stack_there(
    make, episodes, device: str, padding: str, axis: int
) -> None:
    """Every transition, episode starts (padded) and terminal ones (their true next stack)
    included, is sampled from a ring on `device` exactly as the env gave it."""
    transitions = laid_out(episodes[padding], axis)
    manager = make(device=device, axis=axis)
    truth = fill(manager, transitions, check=False)
    seen: set[tuple[bytes, bytes]] = set()
    with manager.torch_batches(32, transitions=True, device=device) as stream:
        for _, batch in zip(range(80), stream, strict=False):
            assert batch.states.device.type == device == batch.next_states.device.type
            seen.update(
                (s.cpu().numpy().tobytes(), n.cpu().numpy().tobytes())
                for s, n in zip(batch.states, batch.next_states, strict=True)
            )
    # 2,560 uniform draws of 160 items: every one is drawn (missed with odds of 2e-5).
    assert seen == truth
    check_items(manager, transitions)


# ------------------------------------------------------------------------- compression


def batches(manager: ReplayBufferManager, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `count` batches of 32 transitions `(states, next states)` of torch_batches."""
    out = []
    for batch in itertools.islice(manager.torch_batches(32, transitions=True), count):
        out.append((batch.states.numpy().copy(), batch.next_states.numpy().copy()))
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_compressed_frames_read_back_exactly(make, episodes, tmp_path, compression: str) -> None:
    transitions = episodes["reset"]
    plain = make("plain", capacity=150)
    packed = make("packed", capacity=150, compression=compression)
    for manager in (plain, packed):
        manager.create_replay_buffer()
        write(manager, transitions)
    stored = table(packed)
    per_step = stored.nbytes / stored.step_capacity
    assert per_step <= (800 if compression == "lz4" else 700), per_step
    assert table(plain).nbytes / table(plain).step_capacity > FRAME_BYTES
    for got, want in zip(batches(packed, 3), batches(plain, 3), strict=True):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    epochs = [
        [
            (b.states.numpy().copy(), b.next_states.numpy().copy())
            for b in m.epoch_batches(64, seed=1, transitions=True)
        ]
        for m in (packed, plain)
    ]
    assert len(epochs[0]) == len(epochs[1]) >= 2
    for got, want in zip(*epochs, strict=True):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    windows = next(iter(packed.torch_batches(16)))
    assert windows.observation.shape == (16, 2, 4, 84, 84)
    before = items(plain)
    for got, want in zip(items(packed), before, strict=True):
        np.testing.assert_array_equal(got, want)
    packed.export(tmp_path / "export")
    packed.checkpoint()
    packed.close()

    loaded = make("packed", capacity=150, compression=compression)
    loaded.load_replay_buffer()
    for got, want in zip(items(loaded), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert table(loaded).nbytes <= 1.05 * stored.nbytes
    index = Path(loaded._backend.restored_from.path) / "local_checkpoint.json"
    assert json.loads(index.read_text())["compression"] == compression
    loaded.close()
    # Another codec, or none: the checkpoint's items are encoded anew as they are restored.
    other = make("packed", capacity=150, compression=None if compression == "lz4" else "lz4")
    other.load_replay_buffer()
    for got, want in zip(items(other), before, strict=True):
        np.testing.assert_array_equal(got, want)
    imported = make("imported", capacity=150, compression=compression)
    imported.import_buffer(tmp_path / "export")
    for got, want in zip(items(imported), before, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.heavy
def test_compression_without_a_frame_stack_stores_the_images_compressed(make, episodes) -> None:
    transitions = episodes["zero"][:60]
    plain = make("plain", frame_stack=None)
    packed = make("packed", frame_stack=None, compression="lz4")
    for manager in (plain, packed):
        manager.create_replay_buffer()
        write(manager, transitions)
    stored = table(packed)
    assert stored.nbytes < table(plain).nbytes / 10
    for got, want in zip(items(packed), items(plain), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(batches(packed, 2), batches(plain, 2), strict=True):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    check_items(packed, transitions)
    with pytest.raises(ConfigError, match=r"compressed \(compression='lz4'\).*num_workers=0"):
        packed.torch_dataset(16).data_loader(num_workers=2)
    check_items(packed, transitions)  # refused: the table as it was


@pytest.mark.heavy
def test_payloads_the_memory_cannot_hold_are_refused_whole_keeping_the_buffer(
    make, episodes, monkeypatch
) -> None:
    transitions = episodes["reset"][:40]
    packed = make("packed", capacity=1000, compression="lz4")
    packed.create_replay_buffer()
    write(packed, transitions)
    before = [a.copy() for a in items(packed)]
    held = table(packed).nbytes
    # The memory runs out: the next insert past the bytes granted is refused before it
    # changes anything (noise frames do not compress: 1 MiB is reached within 200 steps).
    monkeypatch.setattr(sizes, "available_memory", lambda: 1 << 20)
    rng = np.random.default_rng(0)
    writer = packed.transition_writer()
    state = np.repeat(rng.integers(0, 256, (1, 84, 84), np.uint8), 4, axis=0)  # a reset
    with pytest.raises(ConfigError) as raised:
        for _ in range(200):
            frame = rng.integers(0, 256, (1, 84, 84), np.uint8)
            next_state = np.concatenate([state[1:], frame])
            count, nbytes = table(packed).size, table(packed).nbytes
            writer.add(state, 1, 0.0, next_state, False)
            state = next_state
    message = str(raised.value)
    assert "table 'uniform_table' cannot store" in message
    assert f"but {1 << 20} bytes (1.0 MiB) of memory are available" in message
    assert "nothing was written" in message
    assert table(packed).size == count and table(packed).nbytes == nbytes
    assert table(packed).nbytes > held
    after = items(packed)
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got[: len(want)], want)
    assert len(batches(packed, 2)) == 2  # still readable
    packed.checkpoint()


class _CountingRng:
    """A generator that counts its `integers` calls (one per draw of a table)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.calls = 0

    def integers(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.rng.integers(*args, **kwargs)


def test_transition_streams_draw_several_batches_per_table_call(make, episodes) -> None:
    """A frame-stacked table's transition stream draws 16 batches of indices at once and
    gathers each batch's frames as it is handed out, counting its draws then."""
    manager = make()
    manager.create_replay_buffer()
    write(manager, episodes["reset"])
    counting = table(manager)._rng = _CountingRng(table(manager)._rng)
    truth = pairs(episodes["reset"])
    with manager.torch_batches(32, transitions=True) as stream:
        for count, batch in enumerate(itertools.islice(stream, 20), start=1):
            got = {
                (s.numpy().tobytes(), n.numpy().tobytes())
                for s, n in zip(batch.states, batch.next_states, strict=True)
            }
            assert got <= truth
            assert table(manager).samples == 32 * count  # counted as handed out
    assert counting.calls == 2  # batches 1-16, 17-20
    assert int(table(manager)._times_sampled.sum()) == 20 * 32


@pytest.mark.heavy
@pytest.mark.parametrize("padding", ["reset", "zero"])
def test_batches_drawn_ahead_whose_items_left_are_drawn_again(make, episodes, padding) -> None:
    """Steps written between batches evict items of batches drawn ahead, and grow the ring:
    those batches are drawn again, and every batch reads the env's stacks."""
    transitions = episodes[padding]
    manager = make(capacity=20)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for transition in transitions[:30]:
        writer.add(*transition)
    truth = pairs(transitions)
    counting = table(manager)._rng = _CountingRng(table(manager)._rng)
    with manager.torch_batches(8, transitions=True, with_info=True) as stream:
        for transition in transitions[30:]:
            writer.add(*transition)  # evicts the oldest item
            batch, info = next(stream)
            got = {
                (s.numpy().tobytes(), n.numpy().tobytes())
                for s, n in zip(batch.states, batch.next_states, strict=True)
            }
            assert got <= truth
            assert (info.table_size == table(manager).size).all()
    assert counting.calls > 1
    assert table(manager).samples == 8 * (len(transitions) - 30)


@pytest.mark.heavy
def test_two_compressed_tables_share_one_grant_of_memory(make, monkeypatch) -> None:
    """The tables of a backend are granted the free memory once between them: the payloads
    both hold never outgrow what the memory had room for."""
    manager = make(
        "two",
        compression="lz4",
        extra_tables=(TableConfig("other", 1000, 2, frame_stack=4),),
    )
    manager.create_replay_buffer()
    client = manager._backend.client
    tables = [client.table(manager.table_name), client.table("other")]

    def held() -> int:
        return sum(t._columns[t.frames.field].nbytes for t in tables if t._columns is not None)

    room = 3 << 19  # 1.5 MiB: the memory shrinks as the payloads of both tables grow
    monkeypatch.setattr(sizes, "available_memory", lambda: compressed.MEMORY_MARGIN + room - held())
    rng = np.random.default_rng(0)
    state = np.repeat(rng.integers(1, 256, (1, 84, 84), np.uint8), 4, axis=0)
    writer = manager.transition_writer()
    peak = 0
    with pytest.raises(ConfigError, match="cannot store"):
        for _ in range(400):  # noise frames: about 7 KB each, in each table
            next_state = np.concatenate([state[1:], rng.integers(1, 256, (1, 84, 84), np.uint8)])
            writer.add(state, 1, 0.0, next_state, False)
            state = next_state
            peak = max(peak, held())
    assert room // 2 < peak <= room + (64 << 10)  # the slots' pointers are not granted
    assert tables[0].size > 100 and tables[0].size == tables[1].size
    assert len(batches(manager, 1)) == 1  # refused: the tables as they were, readable


@pytest.mark.heavy
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_restores_and_imports_store_each_step_once_as_the_writers_did(
    make_from_spaces, tmp_path, compression: str | None
) -> None:
    """Two writers interleave episodes of 1 to 16 steps (both paddings): a checkpoint
    restored and an export imported hold the frames and bytes the writers' table held, and
    read back the same stacks (episode starts and terminal transitions)."""
    make_one = functools.partial(
        make_from_spaces,
        "local",
        observation=spaces.Box(0, 255, (4, 8, 8), np.uint8),
        action=spaces.Discrete(4),
        capacity=1000,
        frame_stack=4,
        compression=compression,
        timeouts=FAST,
    )
    source = make_one("source")
    truth = interleave(source, LENGTHS)
    before, epoch = reads(source)
    assert epoch == truth
    steps, nbytes = stored(source)
    assert steps == 2 * (sum(LENGTHS) + len(LENGTHS))  # each step once
    source.checkpoint()
    source.export(tmp_path / "export")
    source.close()
    restored = make_one("source")
    restored.load_replay_buffer()
    imported = make_one("imported")
    imported.import_buffer(tmp_path / "export")
    for copy in (restored, imported):
        assert stored(copy) == (steps, nbytes)
        got, got_epoch = reads(copy)
        assert got_epoch == truth
        for array, want in zip(got, before, strict=True):
            np.testing.assert_array_equal(array, want)
