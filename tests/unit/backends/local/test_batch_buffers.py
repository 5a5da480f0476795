"""`batch_buffers`: an array is handed out again only once nothing refers to it (a batch's
tensor, a view of it, a numpy array made from it), and the pool keeps to its bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_service.backends.local import batch_buffers
from replay_service.backends.local.batch_buffers import BatchBuffers
from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig

pytestmark = pytest.mark.local

SHAPE = (32, 5, 84, 84)


def test_an_array_is_reused_only_once_nothing_refers_to_it() -> None:
    buffers = BatchBuffers()
    array = buffers.empty(SHAPE, np.uint8)
    address = array.ctypes.data
    held = torch.from_numpy(array[:, :4])
    del array
    assert buffers.empty(SHAPE, np.uint8).ctypes.data != address  # a tensor of it is held
    view = held[1:]
    del held
    assert buffers.empty(SHAPE, np.uint8).ctypes.data != address  # a view of the tensor
    as_numpy = view.numpy()
    del view
    assert buffers.empty(SHAPE, np.uint8).ctypes.data != address  # a numpy array of it
    storage = torch.from_numpy(as_numpy).untyped_storage()
    del as_numpy
    assert buffers.empty(SHAPE, np.uint8).ctypes.data != address  # its storage
    del storage
    assert buffers.empty(SHAPE, np.uint8).ctypes.data == address


def test_a_held_array_is_never_written_by_later_batches() -> None:
    buffers = BatchBuffers()
    held = []
    for value in range(3 * batch_buffers.KEEP):
        array = buffers.empty(SHAPE, np.uint8)
        array.fill(value)
        if value % 2 == 0:
            held.append((value, torch.from_numpy(array)))
        del array
    for value, tensor in held:
        assert bool((tensor == value).all())


def test_arrays_in_use_for_long_are_replaced_in_the_pool() -> None:
    buffers = BatchBuffers()
    kept_for_long = [buffers.empty(SHAPE, np.uint8) for _ in range(batch_buffers.KEEP)]
    addresses = set()
    for _ in range(3 * batch_buffers.KEEP):
        array = buffers.empty(SHAPE, np.uint8)
        addresses.add(array.ctypes.data)
        del array
    assert not addresses & {a.ctypes.data for a in kept_for_long}
    # Once the long-held arrays left the pool, a free one is handed out again and again.
    first = buffers.empty(SHAPE, np.uint8).ctypes.data
    assert all(buffers.empty(SHAPE, np.uint8).ctypes.data == first for _ in range(5))


def test_small_and_huge_arrays_are_not_kept() -> None:
    buffers = BatchBuffers()
    small = buffers.empty((8,), np.float32)
    huge_shape = (batch_buffers.MAX_BYTES + 1,)
    huge = buffers.empty(huge_shape, np.uint8)
    assert small.shape == (8,) and huge.shape == huge_shape
    assert buffers._bytes == 0 and not any(buffers._kept.values())


def test_the_kept_bytes_and_shapes_are_bounded() -> None:
    buffers = BatchBuffers()
    held = []
    for rows in range(1, 3 * batch_buffers.MAX_SHAPES):
        for _ in range(batch_buffers.KEEP + 1):
            held.append(buffers.empty((rows, 1 << 20), np.uint8))
    assert len(buffers._kept) <= batch_buffers.MAX_SHAPES
    assert buffers._bytes <= batch_buffers.MAX_KEPT_BYTES
    assert buffers._bytes == sum(a.nbytes for kept in buffers._kept.values() for a in kept)


K = 4
SIDE = 64  # a batch of 32 transitions' frames: 640 KB, gathered into kept arrays
STACKED = [
    {"path": "observation", "dtype": "uint8", "shape": [K, SIDE, SIDE]},
    {"path": "reward", "dtype": "float32", "shape": []},
]
PAIR = [(0, 0), (0, 1), (1, 0)]


def stack(newest: int) -> np.ndarray:
    return np.stack([np.full((SIDE, SIDE), max(1, newest - K + 1 + i), np.uint8) for i in range(K)])


def stacked_table(compression: str | None, frame_stack: int | None) -> LocalTable:
    config = TableConfig("t", 64, 2, frame_stack=frame_stack)
    table = LocalTable(config, STACKED, seed=0, compression=compression)
    items = 40
    windows = np.stack([np.stack([stack(i), stack(i + 1)]) for i in range(1, items + 1)])
    rewards = np.arange(1, items + 1, dtype=np.float32)[:, None].repeat(2, 1)
    table.insert([windows, rewards], np.ones(items))
    return table


@pytest.mark.parametrize(
    ("compression", "frame_stack"), [(None, None), (None, K), ("lz4", K), ("zstd", K)]
)
def test_batches_a_caller_holds_keep_their_values_while_later_ones_are_read(
    compression: str | None, frame_stack: int | None
) -> None:
    table = stacked_table(compression, frame_stack)
    reads = [
        lambda: table.sample(32, 1.0, with_info=False)[0],
        lambda: table.sample(32, 1.0, with_info=False, steps=PAIR)[0],
    ]
    if table.pair_steps(PAIR):
        drawn = table.draw_pairs(32, 16, PAIR, timeout=1.0)
        pairs = iter(range(16))
        reads.append(lambda: list(table.read_pairs(drawn, next(pairs), with_info=False)[0]))
    for read in reads:
        held = [read() for _ in range(3)]
        copies = [[t.clone() for t in batch] for batch in held]
        for _ in range(12):
            read()
        for batch, copy in zip(held, copies, strict=True):
            for tensor, expected in zip(batch, copy, strict=True):
                assert torch.equal(tensor, expected)
        # And every stack held is a real one: its frames count up to its newest.
        for batch in held:
            for tensor in batch:
                if tensor.dtype == torch.uint8:
                    frames = tensor.reshape(-1, K, SIDE * SIDE)[:, :, 0].numpy().astype(int)
                    steps = np.diff(frames, axis=1)
                    assert ((steps == 1) | ((steps == 0) & (frames[:, 1:] == 1))).all()
