"""`sample.epochs`, through `manager.epoch_batches` on the local backend: a pass is a snapshot
of one table taken when it is made, its batch count follows
`drop_last`, an unseeded pass draws new permutations on every iteration, and padded tables
refuse transitions. (Every item once per epoch, seeds and bad options, on both backends:
test_extras_epochs.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from replay_service import ConfigError, TableConfig
from replay_service.specs.windows import Masked

RECENT = "recent"


def state(episode: int, index: int) -> np.ndarray:
    return np.array([episode, index, 0, 0], np.float32)


def write(writer, episodes: range, length: int) -> None:
    """`length` transitions per episode: `length` items of 2 steps each."""
    for episode in episodes:
        for i in range(length):
            writer.add(state(episode, i), 0, 1.0, state(episode, i + 1), i == length - 1)


def firsts(batch) -> list[tuple[int, int]]:
    observation = batch.observation if not isinstance(batch, Masked) else batch.step.observation
    return [(int(e), int(i)) for e, i in observation[:, 0, :2].tolist()]


def test_a_pass_is_a_snapshot_taken_when_it_is_made(make_from_spaces):
    manager = make_from_spaces("local")
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    write(writer, range(2), 5)
    epochs = manager.epoch_batches(4, seed=0)
    write(writer, range(2, 4), 5)  # after the snapshot: not in the pass
    writer.flush()
    seen = [key for batch in epochs for key in firsts(batch)]
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(5)]
    assert epochs.num_items == 10 and manager.num_frames() == 20


@pytest.mark.parametrize(
    ("batch_size", "drop_last", "sizes"),
    [(5, False, [5, 5]), (5, True, [5, 5]), (4, False, [4, 4, 2]), (4, True, [4, 4])],
)
def test_batch_count_follows_drop_last(make_from_spaces, batch_size, drop_last, sizes):
    manager = make_from_spaces("local")
    manager.create_replay_buffer()
    write(manager.transition_writer(), range(2), 5)
    epochs = manager.epoch_batches(batch_size, num_epochs=2, drop_last=drop_last, seed=0)
    assert epochs.batches_per_epoch == len(sizes) and len(epochs) == 2 * len(sizes)
    assert [len(firsts(b)) for b in epochs] == sizes * 2


def test_without_a_seed_each_iteration_draws_new_permutations(make_from_spaces):
    manager = make_from_spaces("local")
    manager.create_replay_buffer()
    write(manager.transition_writer(), range(4), 10)
    epochs = manager.epoch_batches(40)
    orders = {tuple(firsts(next(iter(epochs)))) for _ in range(3)}
    assert len(orders) == 3


def test_a_named_table_is_read_and_named_in_its_errors(make_from_spaces):
    manager = make_from_spaces(
        "local", extra_tables=[TableConfig(name=RECENT, capacity=3, sequence_length=2)]
    )
    manager.create_replay_buffer()
    write(manager.transition_writer(), range(2), 5)
    recent = list(manager.epoch_batches(3, table=RECENT, seed=0))
    assert len(recent) == 1 and sorted(firsts(recent[0])) == [(1, 2), (1, 3), (1, 4)]
    assert [len(firsts(b)) for b in manager.epoch_batches(4, table=RECENT)] == [3]
    with pytest.raises(
        ConfigError, match=f"batch_size=4 leaves no batch: table {RECENT!r} holds 3 items"
    ):
        manager.epoch_batches(4, table=RECENT, drop_last=True)


def test_a_padded_table_yields_masked_items_and_refuses_transitions(make_from_spaces):
    manager = make_from_spaces("local", sequence_length=4, pad_end_of_episode=True)
    manager.create_replay_buffer()
    write(manager.transition_writer(), range(1), 2)  # 3 steps and one padding step
    (batch,) = list(manager.epoch_batches(8, seed=0))
    assert isinstance(batch, Masked)
    assert batch.mask.tolist() == [[True, True, True, False]]
    with pytest.raises(ConfigError, match=r"transitions=True does not apply to table .*Masked"):
        manager.epoch_batches(2, transitions=True)
