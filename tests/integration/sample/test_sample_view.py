"""`sample.view.SampleView`, through the manager's sampling on the local backend: the table a
call names is the one sampled and the one `epoch_batches`' batch-size check measures (by its own
sequence length), and an unknown table is refused listing the buffer's tables. (The ceilings
and devices themselves, on every entry point and both backends: test_batch_bounds.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

from replay_service import BufferStateError, ConfigError, TableConfig
from replay_service.config.batch_limits import MAX_BATCH_SIZE, SAMPLE_INFO_BYTES

LONG = "long"
HUGE = MAX_BATCH_SIZE + 1


def state(index: int) -> np.ndarray:
    return np.array([index, 0, 0, 0], np.float32)


@pytest.fixture()
def manager(make_from_spaces):
    """A primary table of 2-step items and "long", of 5-step items, both filled from one
    episode of 9 transitions (10 steps)."""
    made = make_from_spaces(
        "local", extra_tables=[TableConfig(name=LONG, capacity=100, sequence_length=5)]
    )
    made.create_replay_buffer()
    writer = made.transition_writer()
    for i in range(9):
        writer.add(state(i), 0, 1.0, state(i + 1), i == 8)
    writer.flush()
    return made


def per_item_bytes(message: str) -> int:
    found = re.search(r"\((\d+) bytes each\)", message)
    assert found, message
    return int(found.group(1)) - SAMPLE_INFO_BYTES


def test_the_named_table_is_sampled(manager):
    assert (manager.num_frames(), manager.num_frames(table=LONG)) == (9, 6)
    batch = next(iter(manager.torch_batches(16, table=LONG, prefetch=0)))
    assert batch.observation.shape == (16, 5, 4)
    starts = batch.observation[:, 0, 0].tolist()
    assert set(starts) <= {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}
    np.testing.assert_array_equal(batch.observation[:, 4, 0], batch.observation[:, 0, 0] + 4)
    primary = next(iter(manager.torch_batches(16, prefetch=0)))
    assert primary.observation.shape == (16, 2, 4)


def test_the_batch_check_measures_the_named_tables_items(manager):
    with pytest.raises(ConfigError, match=f"of table {manager.table_name!r}") as primary:
        manager.epoch_batches(HUGE)
    with pytest.raises(ConfigError, match=f"of table {LONG!r}") as long:
        manager.epoch_batches(HUGE, table=LONG)
    step_bytes = per_item_bytes(str(primary.value)) // 2
    assert per_item_bytes(str(long.value)) == 5 * step_bytes


def test_an_unknown_table_is_refused_listing_the_tables(manager):
    with pytest.raises(ConfigError, match=r"unknown table 'nope'.*\['.*', 'long'\]"):
        manager.torch_batches(4, table="nope")
    with pytest.raises(ConfigError, match="unknown table 'nope'"):
        manager.torch_dataset(4, table="nope")
    with pytest.raises(ConfigError, match="unknown table 'nope'"):
        manager.epoch_batches(4, table="nope")


def test_sampling_before_the_buffer_exists_is_refused(make_from_spaces):
    manager = make_from_spaces("local")
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.torch_batches(4)
