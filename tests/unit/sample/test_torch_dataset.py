"""`torch_dataset.TorchReplayDataset`: batches of any torch source in a process or DataLoader
workers, and the worker start methods `data_loader()` allows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from replay_service.errors import ConfigError
from replay_service.sample.sources import PackingSource, SampleRequest, TorchSamples
from replay_service.sample.torch_dataset import TorchReplayDataset

pytestmark = pytest.mark.local


class Steps(PackingSource):
    """2-step items `{"x": [k, k + 1]}`, counting up; fork-safe (no thread or connection)."""

    table_name = "steps"
    sequence_length = 2
    item_bytes = 16
    fork_safe = True

    def __init__(self) -> None:
        self.signature = {"x": 0}
        self.prepared = False

    def prepare_workers(self) -> None:
        self.prepared = True

    def _samples(self, request: SampleRequest) -> TorchSamples:
        start = 0
        while True:
            rows = torch.arange(start, start + request.batch_size)
            data = [torch.stack([rows, rows + 1], 1)]
            start += request.batch_size
            info = tuple(torch.zeros(request.batch_size) for _ in range(5))
            yield request.pack.build(request.pack.prepare(data)), info


def first(batches: Iterator[Any]) -> Any:
    return next(iter(batches))


def test_iterating_in_process_yields_the_sources_batches():
    dataset = TorchReplayDataset(Steps(), 3)
    assert first(dataset)["x"].tolist() == [[0, 1], [1, 2], [2, 3]]
    data, info = first(TorchReplayDataset(Steps(), 2, with_info=True))
    assert data["x"].shape == (2, 2) and info.key.shape == (2,)


def test_options_are_checked_when_the_dataset_is_made():
    with pytest.raises(ConfigError, match="batch_size"):
        TorchReplayDataset(Steps(), 0)
    with pytest.raises(ConfigError, match="transitions must be True or False"):
        TorchReplayDataset(Steps(), 2, transitions="yes")  # type: ignore[arg-type]


def test_data_loader_prepares_the_workers_and_checks_the_start_method():
    source = Steps()
    dataset = TorchReplayDataset(source, 2)
    loader = dataset.data_loader(0)
    assert loader.num_workers == 0 and not source.prepared
    loader = dataset.data_loader(1, multiprocessing_context="fork")
    assert loader.num_workers == 1 and source.prepared
    with pytest.raises(ConfigError, match="multiprocessing_context must be one of"):
        dataset.data_loader(1, multiprocessing_context="thread")
    with pytest.raises(ConfigError, match="num_workers"):
        dataset.data_loader(-1)
