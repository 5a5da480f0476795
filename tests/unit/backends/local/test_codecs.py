"""`codecs`: every codec gives values back bit for bit, whole batches into one array on one
thread or several; unknown or missing codecs, corrupt payloads and the size estimate."""

from __future__ import annotations

import os

import numpy as np
import pytest

from codec_cases import NAMES, SHAPE, frames, installed
from replay_service.backends.local import codecs
from replay_service.backends.local.codecs import codec
from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.errors import ConfigError

pytestmark = pytest.mark.local


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["random", "zeros", "frames"])
def test_values_come_back_bit_for_bit(name: str, kind: str) -> None:
    rng = np.random.default_rng(1)
    values = {
        "random": rng.integers(0, 256, (20, *SHAPE), dtype=np.uint8),
        "zeros": np.zeros((20, *SHAPE), np.uint8),
        "frames": frames(20),
    }[kind]
    column = CompressedColumn(20, SHAPE, np.uint8, name)
    column.write(np.arange(20), values)
    order = rng.permutation(20)
    np.testing.assert_array_equal(column.read(order), values[order])


@pytest.mark.parametrize("name", NAMES)
def test_other_dtypes_and_shapes_come_back_bit_for_bit(name: str) -> None:
    values = np.random.default_rng(2).standard_normal((6, 3, 5)).astype(np.float32)
    values[0, 0, 0] = np.nan
    column = CompressedColumn(6, (3, 5), np.float32, name)
    column.write(np.arange(6), values)
    assert column.read(np.arange(6)).tobytes() == values.tobytes()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_is_read_into_out_on_any_number_of_threads(name: str, threads: int) -> None:
    values = frames(50)
    column = CompressedColumn(50, SHAPE, np.uint8, name)
    column.write(np.arange(50), values)
    slots = np.random.default_rng(3).integers(0, 50, 160)  # over PARALLEL_MIN, repeats
    assert len(slots) >= codecs.PARALLEL_MIN
    out = np.full((160, *SHAPE), 7, np.uint8)
    assert column.read(slots, out, threads=threads) is out
    np.testing.assert_array_equal(out, values[slots])


def test_compressed_frames_are_smaller_than_their_values() -> None:
    values = frames(10)
    for name in ("zstd", "lz4"):
        if installed(name):
            column = CompressedColumn(10, SHAPE, np.uint8, name)
            column.write(np.arange(10), values)
            assert column.payload_bytes < values.nbytes / 2, name


def test_an_unknown_codec_is_a_config_error_naming_it_and_the_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"one of \['lz4', 'none', 'zstd'\] or None, got 'brotli'"
    ):
        codec("brotli")
    with pytest.raises(ConfigError, match="got 3"):
        CompressedColumn(4, SHAPE, np.uint8, 3)  # type: ignore[arg-type]


def test_a_missing_library_is_a_config_error_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codecs.Lz4Codec, "module", "lz4_not_installed_here")
    with pytest.raises(ConfigError, match=r"compression='lz4' needs the 'lz4' package.*pip"):
        codec("lz4")


def test_bad_arguments_are_refused() -> None:
    column = CompressedColumn(4, SHAPE, np.uint8, "none")
    with pytest.raises(ValueError, match=r"slots \[4, -1\] are out of range"):
        column.write(np.array([4, -1]), frames(2))
    with pytest.raises(ValueError, match="do not fit"):
        column.write(np.arange(2), frames(2).astype(np.int16))
    with pytest.raises(ValueError, match="2 slots for 1 payloads"):
        column.store(np.arange(2), [b"x" * column.value_bytes])
    column.write(np.arange(2), frames(2))
    with pytest.raises(ValueError, match=r"out must be a C-contiguous uint8 array of shape"):
        column.read(np.arange(2), np.empty((3, *SHAPE), np.uint8))
    with pytest.raises(ConfigError, match="slots >= 0, got -1"):
        CompressedColumn(-1, SHAPE, np.uint8, "none")


@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] != "none"])
def test_a_corrupt_payload_is_a_value_error(name: str) -> None:
    column = CompressedColumn(1, SHAPE, np.uint8, name)
    column.store(np.array([0]), [b"\x00garbage" * 3])
    with pytest.raises(ValueError, match="does not decode"):
        column.read(np.array([0]))


def test_decode_threads_are_bounded() -> None:
    assert 1 <= codecs.decode_threads() <= min(codecs.MAX_THREADS, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def breakout() -> np.ndarray:
    """300 preprocessed Breakout frames (skips without ale-py)."""
    return breakout_frames(300)


def breakout_frames(steps: int) -> np.ndarray:
    """`steps` preprocessed Breakout frames under a seeded random policy (84x84 uint8), as
    scripts/codec_benchmark.py makes them."""
    ale_py = pytest.importorskip("ale_py")
    gym = pytest.importorskip("gymnasium")
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)
    env = AtariPreprocessing(gym.make("BreakoutNoFrameskip-v4"), frame_skip=4, noop_max=0)
    rng = np.random.default_rng(0)
    observation, _ = env.reset(seed=0)
    observations = [observation]
    while len(observations) < steps:
        observation, _, terminated, truncated, _ = env.step(int(rng.integers(4)))
        observations.append(observation)
        if terminated or truncated:
            observations.append(env.reset()[0])
    env.close()
    return np.stack(observations[:steps])


@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] != "none"])
def test_a_breakout_frame_takes_under_800_bytes(name: str, breakout: np.ndarray) -> None:
    values = breakout
    column = CompressedColumn(len(values), values.shape[1:], values.dtype, name)
    column.write(np.arange(len(values)), values)
    assert column.nbytes / len(values) < 800  # payload and slot: 7,056 B raw
    np.testing.assert_array_equal(column.read(np.arange(len(values))), values)


def test_a_manager_takes_compression_on_the_local_backend(tmp_path) -> None:
    from gymnasium import spaces

    from replay_service import ReplayBufferManager

    manager = ReplayBufferManager.from_spaces(
        spaces.Box(0, 255, SHAPE, np.uint8),
        spaces.Discrete(4),
        capacity=10,
        checkpoint_dir=str(tmp_path / "ckpt"),
        compression="zstd",
    )
    try:
        assert manager.backend == "local"
        assert manager._backend.compression == "zstd"
        manager.create_replay_buffer()
        values = frames(6, seed=7)
        writer = manager.transition_writer()
        for index in range(5):
            writer.add(values[index], 1, 0.0, values[index + 1], index == 4, False)
        table = manager._backend.client.table(manager.table_name)
        paths = [f["path"] for f in table.fields]
        columns = dict(zip(paths, map(type, table._columns), strict=True))
        assert columns["observation"] is CompressedColumn  # 7,056 B per step
        assert columns["action"] is np.ndarray  # small fields stay plain
        observations = manager._backend.read_items(manager.table_config).data[
            paths.index("observation")
        ]
        np.testing.assert_array_equal(observations[:, 0], values[:5])
        np.testing.assert_array_equal(observations[:, 1], values[1:6])
    finally:
        manager.close()
    with pytest.raises(ConfigError, match=r"got 'zstd-9'"):
        ReplayBufferManager.from_spaces(
            spaces.Discrete(3),
            spaces.Discrete(4),
            capacity=10,
            checkpoint_dir=str(tmp_path / "other"),
            compression="zstd-9",
        )


@pytest.mark.parametrize("name", ["lz4", "zstd", "none"])
def test_a_slot_is_estimated_at_an_eighth_of_its_value_or_its_raw_bytes(name: str) -> None:
    expected = 7056 if name == "none" else 882
    assert codecs.estimated_bytes(7056, name) == expected + codecs.SLOT_OVERHEAD


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("count", "threads"), [(5, 1), (100, 1), (100, 3)])
def test_decode_take_decodes_each_payload_once_into_every_place(
    name: str, count: int, threads: int
) -> None:
    values = frames(count, seed=8)
    column = CompressedColumn(count, SHAPE, np.uint8, name)
    column.write(np.arange(count), values)
    payloads = column.gather(np.arange(count))
    take = np.random.default_rng(9).integers(0, count, (32, 2, 4))  # stacks sharing frames
    got = column.decode_take(payloads, take, threads=threads)
    assert got.shape == (32, 2, 4, *SHAPE) and got.flags.writeable
    np.testing.assert_array_equal(got, values[take])
    assert column.decode_take(payloads, np.zeros(0, np.int64)).shape == (0, *SHAPE)
    with pytest.raises(ValueError, match="out of range of"):
        column.decode_take(payloads, np.array([count]))


@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] != "none"])
@pytest.mark.parametrize("count", [1, 100])
def test_decode_take_refuses_a_corrupt_or_short_payload(name: str, count: int) -> None:
    values = frames(count, seed=10)
    column = CompressedColumn(count, SHAPE, np.uint8, name)
    column.write(np.arange(count), values)
    short = column.codec.encode(values[0].reshape(-1)[:100].copy())
    for bad in (b"\x00garbage" * 3, short):
        payloads = column.gather(np.arange(count))
        payloads[count // 2] = bad
        with pytest.raises(ValueError, match="decode"):
            column.decode_take(payloads, np.arange(count), threads=3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("count", "threads"), [(100, 1), (codecs.LZ4_PARALLEL_MIN + 10, 3)]
)  # lz4 decodes on threads from `LZ4_PARALLEL_MIN` payloads
def test_decode_take_fills_the_array_it_is_given(name: str, count: int, threads: int) -> None:
    values = frames(count, seed=11)
    column = CompressedColumn(count, SHAPE, np.uint8, name)
    column.write(np.arange(count), values)
    payloads = column.gather(np.arange(count))
    take = np.random.default_rng(12).integers(0, count, (16, 5))
    out = np.full((16, 5, *SHAPE), 7, np.uint8)
    got = column.decode_take(payloads, take, threads=threads, out=out)
    assert got is out
    np.testing.assert_array_equal(out, values[take])
    for wrong in (np.empty((16, 4, *SHAPE), np.uint8), np.empty((16, 5, *SHAPE), np.int16)):
        with pytest.raises(ValueError, match="out must be"):
            column.decode_take(payloads, take, out=wrong)


@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] != "none"])
def test_decode_take_refuses_a_short_payload_on_threads(name: str) -> None:
    count = codecs.LZ4_PARALLEL_MIN + 10
    values = frames(count, seed=13)
    column = CompressedColumn(count, SHAPE, np.uint8, name)
    column.write(np.arange(count), values)
    payloads = column.gather(np.arange(count))
    payloads[count - 3] = column.codec.encode(values[0].reshape(-1)[:100].copy())
    with pytest.raises(ValueError, match="decode"):
        column.decode_take(payloads, np.arange(count), threads=3)
