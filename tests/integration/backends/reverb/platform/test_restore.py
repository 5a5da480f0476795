"""The restore view of a Reverb checkpoint: each table configured now gets its options and
rebased counters, other tables keep theirs, and items sampled as often as a lower
`max_times_sampled` allows are left out (counted as deleted); the checkpoint is untouched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import reverb

from conftest import tree_digest
from replay_service.backends.reverb.platform.checkpoint_files import (
    ITEMS_FILE,
    TABLES_FILE,
    read_records,
)
from replay_service.backends.reverb.platform.restore import lowers_max_times_sampled, restore_view
from replay_service.errors import CheckpointError

ITEMS = 6
SAMPLED = 3  # times the oldest item of `fifo` was sampled


def _fifo() -> reverb.Table:
    return reverb.Table(
        name="fifo",
        sampler=reverb.selectors.Fifo(),
        remover=reverb.selectors.Fifo(),
        max_size=100,
        rate_limiter=reverb.rate_limiters.MinSize(1),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`fifo` (6 items, the oldest sampled 3 times, unlimited) and `keep` (one item)."""
    root = tmp_path_factory.mktemp("reverb")
    server = reverb.Server(
        [_fifo(), reverb.Table.queue("keep", 10)],
        checkpointer=reverb.checkpointers.DefaultCheckpointer(str(root)),
    )
    try:
        client = reverb.Client(f"localhost:{server.port}")
        for i in range(ITEMS):
            client.insert([np.int32(i)], {"fifo": 1.0})
        client.insert([np.int32(99)], {"keep": 1.0})
        for _ in range(SAMPLED):
            next(iter(client.sample("fifo", num_samples=1)))
        return client.checkpoint()
    finally:
        server.stop()


def _stored_tables(path: str) -> dict[str, object]:
    from reverb.cc.checkpointing import checkpoint_pb2

    tables = [
        checkpoint_pb2.PriorityTableCheckpoint.FromString(r)
        for r in read_records(path, TABLES_FILE)
    ]
    return {t.table_name: t for t in tables}


def _now(max_times_sampled: int) -> reverb.Table:
    return reverb.Table(
        name="fifo",
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Lifo(),
        max_size=100,
        max_times_sampled=max_times_sampled,
        rate_limiter=reverb.rate_limiters.SampleToInsertRatio(2.0, 4, 3.0),
    )


@pytest.mark.heavy
def test_the_view_takes_the_tables_options_of_now_and_rebases_the_counters(
    checkpoint: str, tmp_path: Path
) -> None:
    before = tree_digest(Path(checkpoint))
    view, dropped = restore_view(checkpoint, [_now(0)], str(tmp_path / "view"))
    assert (view, dropped) == (str(tmp_path / "view"), 0)
    assert tree_digest(Path(checkpoint)) == before
    stored, rewritten = _stored_tables(checkpoint), _stored_tables(view)
    table = rewritten["fifo"]
    assert table.sampler.HasField("uniform") and table.remover.HasField("lifo")
    limiter = table.rate_limiter
    assert limiter.samples_per_insert == 2.0 and limiter.min_size_to_sample == 4
    assert limiter.insert_count == ITEMS
    # mid-band: inserts * samples_per_insert - samples == samples_per_insert * min_size
    assert limiter.sample_count == max(0, round(ITEMS * 2.0 - 2.0 * 4))
    assert rewritten["keep"] == stored["keep"]  # not configured now: as stored
    for name in os.listdir(checkpoint):  # the other files are the checkpoint's own
        if name != TABLES_FILE:
            assert os.path.samefile(os.path.join(checkpoint, name), os.path.join(view, name))


@pytest.mark.heavy
def test_items_sampled_up_to_a_lower_limit_are_left_out_and_counted_deleted(
    checkpoint: str, tmp_path: Path
) -> None:
    view, dropped = restore_view(checkpoint, [_now(SAMPLED)], str(tmp_path / "view"))
    assert dropped == 1
    limiter = _stored_tables(view)["fifo"].rate_limiter
    assert limiter.delete_count == _stored_tables(checkpoint)["fifo"].rate_limiter.delete_count + 1
    from reverb.cc import schema_pb2

    def sampled(path: str) -> list[int]:
        items = [schema_pb2.PrioritizedItem.FromString(r) for r in read_records(path, ITEMS_FILE)]
        return sorted(item.times_sampled for item in items if item.table == "fifo")

    assert sampled(checkpoint) == [0] * (ITEMS - 1) + [SAMPLED]
    assert sampled(view) == [0] * (ITEMS - 1)  # the item sampled 3 times is left out
    server = reverb.Server(
        [_now(SAMPLED), reverb.Table.queue("keep", 10)],
        checkpointer=reverb.checkpointers.DefaultCheckpointer(
            str(tmp_path / "root"), fallback_checkpoint_path=view
        ),
    )
    try:
        client = reverb.Client(f"localhost:{server.port}")
        info = client.server_info(timeout=5)
        assert info["fifo"].current_size == ITEMS - 1
        assert info["keep"].current_size == 1
    finally:
        server.stop()


def test_a_higher_limit_keeps_every_item_and_replaces_an_old_view(
    checkpoint: str, tmp_path: Path
) -> None:
    (tmp_path / "view").mkdir()
    (tmp_path / "view" / "stale").write_text("old")
    view, dropped = restore_view(checkpoint, [_now(SAMPLED + 1)], str(tmp_path / "view"))
    assert dropped == 0
    assert not os.path.exists(os.path.join(view, "stale"))


def test_a_checkpoint_without_tables_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / TABLES_FILE).write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="cannot read"):
        restore_view(str(tmp_path / "ckpt"), [_now(0)], str(tmp_path / "view"))


@pytest.mark.parametrize(
    ("stored", "configured", "lowers"),
    [(0, 0, False), (5, 0, False), (0, 3, True), (5, 3, True), (3, 3, False), (2, 3, False)],
)
def test_only_a_limit_below_the_stored_one_or_none_lowers_it(stored, configured, lowers) -> None:
    assert lowers_max_times_sampled(stored, configured) is lowers
