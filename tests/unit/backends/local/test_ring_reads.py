"""`ring_reads`: single steps read the same values as the whole windows they belong to, on
plain and compressed columns, and a compressed read decodes once however many parts share it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_service.backends.local.ring_reads import Deferred, _Split
from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig

pytestmark = pytest.mark.local

LENGTH = 3
FIELDS = [
    {"path": "big", "dtype": "float32", "shape": [300]},  # 1,200 bytes: compressed with a codec
    {"path": "n", "dtype": "int64", "shape": []},
]


def filled(compression: str | None) -> LocalTable:
    table = LocalTable(TableConfig("t", 8, LENGTH), FIELDS, seed=0, compression=compression)
    values = np.arange(12)
    steps = values[:, None] * 10 + np.arange(LENGTH)  # item v: steps 10v, 10v + 1, 10v + 2
    big = np.repeat(steps[..., None], 300, axis=-1).astype(np.float32)
    table.insert([big, steps.astype(np.int64)], np.ones(len(values)))
    return table


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_steps_read_alone_equal_the_columns_of_their_windows(compression: str | None) -> None:
    if compression:
        pytest.importorskip("zstandard")
    table = filled(compression)
    slots = np.array([0, 3, 5, 7, 3])
    windows = table.decoded(table._read_slots(slots))
    firsts = windows[1][:, 0].tolist()
    assert len(set(firsts)) == 4 and firsts[1] == firsts[4]  # four items, slot 3 twice
    asked = [(0, 2), (1, 0), (0, 0), (1, 2)]
    steps = table.decoded(table._read_steps(slots, asked))
    for (field, step), got in zip(asked, steps, strict=True):
        torch.testing.assert_close(got, windows[field][:, step])
    # Each window is 3 consecutive steps of one item.
    np.testing.assert_array_equal(
        windows[1].numpy() - windows[1].numpy()[:, :1], np.tile(np.arange(LENGTH), (5, 1))
    )
    np.testing.assert_array_equal(windows[0].numpy()[..., 7], windows[1].numpy())


def test_compressed_reads_are_deferred_and_plain_ones_are_not() -> None:
    pytest.importorskip("zstandard")
    table = filled("zstd")
    data = table._read_slots(np.array([1, 2]))
    assert isinstance(data[0], Deferred)
    assert torch.is_tensor(data[1])
    assert not any(isinstance(d, Deferred) for d in filled(None)._read_slots(np.array([1, 2])))


def test_parts_of_a_split_decode_their_whole_once() -> None:
    calls = []

    def decode() -> torch.Tensor:
        calls.append(1)
        return torch.arange(12).reshape(2, 3, 2)

    split = _Split(Deferred(decode), 3)
    parts = [split.part(i)() for i in (2, 0, 1, 2)]
    assert len(calls) == 1
    torch.testing.assert_close(parts[0], torch.tensor([[4, 5], [10, 11]]))
    torch.testing.assert_close(parts[1], torch.tensor([[0, 1], [6, 7]]))
