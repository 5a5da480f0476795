"""`sources.PackingSource` and `hand_out`: the one `torch_samples` call every torch source
takes, and the batches of one draw handed out one by one."""

from __future__ import annotations

import inspect

import pytest
import torch

from replay_service.errors import ManagerClosedError
from replay_service.sample.batches import Packer, split_batches
from replay_service.sample.sources import PackingSource, SampleRequest, TorchSamples, hand_out

pytestmark = pytest.mark.local


class Counting(PackingSource):
    """Yields the request it got, then batches `[0..batch_size)`."""

    def __init__(self) -> None:
        self.signature = {"a": 0, "b": 0}
        self.requests: list[SampleRequest] = []

    def _samples(self, request: SampleRequest) -> TorchSamples:
        self.requests.append(request)
        while True:
            data = [torch.arange(request.batch_size), torch.zeros(request.batch_size)]
            yield request.pack.build(request.pack.prepare(data)), None


def test_torch_samples_takes_the_protocol_arguments_and_packs_the_item_nest_by_default():
    source = Counting()
    assert {"pack", "with_info", "num_workers", "convert"} <= set(
        inspect.signature(source.torch_samples).parameters
    )
    samples = source.torch_samples(3)
    assert source.requests == []  # nothing happens before the first batch
    data, info = next(samples)
    assert info is None and sorted(data) == ["a", "b"]
    assert data["a"].tolist() == [0, 1, 2]
    (request,) = source.requests
    assert (request.batch_size, request.num_workers, request.with_info) == (3, None, True)


def test_a_given_packer_and_options_reach_the_source_unchanged():
    source = Counting()
    pack = Packer(list, lambda flat: flat[0].sum().item())
    data, _ = next(source.torch_samples(4, num_workers=2, pack=pack, with_info=False))
    assert data == 6
    (request,) = source.requests
    assert request.pack is pack and request.num_workers == 2 and not request.with_info


def test_a_source_without_samples_says_so():
    with pytest.raises(NotImplementedError):
        next(PackingSource().torch_samples(1, pack=Packer(list, list)))


class Drawn:
    """A source whose manager can be closed and whose table can be cleared."""

    def __init__(self) -> None:
        self.closed = False
        self.cleared = 0

    def closed_error(self) -> ManagerClosedError | None:
        return ManagerClosedError("closed") if self.closed else None

    def clears(self) -> int:
        return self.cleared


def draw(draws: int, with_info: bool = True) -> tuple[list, list | None]:
    data = [torch.arange(2 * draws)]
    info = [torch.arange(2 * draws) * 10] if with_info else None
    return (
        split_batches(data, 2, draws),
        None if info is None else split_batches(info, 2, draws),
    )


def test_hand_out_yields_every_batch_of_a_draw_in_order():
    parts, info_parts = draw(3)
    batches = list(hand_out(Drawn(), Packer(list, list), parts, info_parts, 3, 0))
    assert [d[0].tolist() for d, _ in batches] == [[0, 1], [2, 3], [4, 5]]
    assert [i[0].tolist() for _, i in batches] == [[0, 10], [20, 30], [40, 50]]
    parts, _ = draw(2, with_info=False)
    assert [i for _, i in hand_out(Drawn(), Packer(list, list), parts, None, 2, 0)] == [None] * 2


def test_hand_out_stops_at_a_clear_and_raises_once_the_manager_is_closed():
    source = Drawn()
    parts, info_parts = draw(3)
    batches = hand_out(source, Packer(list, list), parts, info_parts, 3, 0)
    next(batches)
    source.cleared = 1
    assert list(batches) == []  # drawn before the clear: dropped
    batches = hand_out(source, Packer(list, list), parts, info_parts, 3, 1)
    next(batches)
    source.closed = True
    with pytest.raises(ManagerClosedError, match="closed"):
        next(batches)
