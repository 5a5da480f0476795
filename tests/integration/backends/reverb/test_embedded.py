"""`EmbeddedBackend`: a Reverb server in this process that owns its checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FAST_TIMEOUTS
from replay_service.backends.base import BackendOptions
from replay_service.backends.reverb.embedded import EmbeddedBackend
from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointExistsError
from replay_service.specs import nests as specs
from replay_service.storage.export import ExportedItems

pytestmark = pytest.mark.heavy

TABLE = TableConfig(name="t", capacity=20, sequence_length=2)


def _options(data_spec: Any, root: Path) -> BackendOptions:
    return BackendOptions(
        tables=(TABLE,),
        data_spec=data_spec,
        stored_spec=data_spec,
        timeouts=FAST_TIMEOUTS,
        checkpoint_dir=str(root),
        keep_checkpoints=2,
    )


def _items(data_spec: Any, count: int) -> ExportedItems:
    """`count` items whose every value is the item's index."""
    data = [
        np.stack([np.full([2, *f["shape"]], i, f["dtype"]) for i in range(count)])
        for f in specs.describe_spec(data_spec)
    ]
    return ExportedItems(
        data=data, priorities=np.ones([count]), times_sampled=np.zeros([count], np.int32)
    )


def test_a_created_server_checkpoints_into_its_directory_and_a_new_one_loads_it(
    data_spec: Any, tmp_path: Path
) -> None:
    backend = EmbeddedBackend.from_options(_options(data_spec, tmp_path / "ckpt"))
    assert backend.checkpoint_dir == str(tmp_path / "ckpt")
    assert backend.last_checkpoint() == (None, None)
    try:
        client = backend.create(overwrite=False)
        backend.insert_items(TABLE, _items(data_spec, 5))
        assert backend.num_items(client, TABLE.name) == 5
        path = backend.checkpoint()
        assert os.path.dirname(path) == os.path.join(backend.checkpoint_dir, "checkpoints")
        last, seconds = backend.last_checkpoint()
        assert last is not None and last.path == path and seconds is not None
    finally:
        backend.close()

    again = EmbeddedBackend.from_options(_options(data_spec, tmp_path / "ckpt"))
    try:
        assert again.num_items(again.load(), TABLE.name) == 5
        kept = sorted(os.listdir(os.path.dirname(path)))
        items = again.read_items(TABLE)
        assert [int(x) for x in items.data[0][:, 0]] == [0, 1, 2, 3, 4]
        assert sorted(os.listdir(os.path.dirname(path))) == kept  # its snapshot is gone again
    finally:
        again.close()


def test_create_refuses_a_directory_with_checkpoints_unless_overwrite(
    data_spec: Any, tmp_path: Path
) -> None:
    first = EmbeddedBackend.from_options(_options(data_spec, tmp_path / "ckpt"))
    try:
        first.create(overwrite=False)
        first.insert_items(TABLE, _items(data_spec, 3))
        first.checkpoint()
    finally:
        first.close()
    second = EmbeddedBackend.from_options(_options(data_spec, tmp_path / "ckpt"))
    try:
        with pytest.raises(CheckpointExistsError):
            second.create(overwrite=False)
        assert second.num_items(second.create(overwrite=True), TABLE.name) == 0
    finally:
        second.close()
