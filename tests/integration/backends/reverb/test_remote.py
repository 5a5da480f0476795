"""`RemoteBackend`: a running Reverb server reached by address, which owns its checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FAST_TIMEOUTS
from replay_service.backends.base import BackendOptions
from replay_service.backends.reverb.embedded import EmbeddedBackend
from replay_service.backends.reverb.remote import RemoteBackend
from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointExistsError
from replay_service.specs import nests as specs
from replay_service.storage.export import ExportedItems

pytestmark = pytest.mark.heavy

TABLE = TableConfig(name="t", capacity=20, sequence_length=2, layout="packed")


@pytest.fixture()
def server(data_spec: Any, tmp_path: Path) -> Any:
    """An embedded server of one packed table holding 4 items, as the remote end."""
    owner = EmbeddedBackend.from_options(
        BackendOptions(
            tables=(TABLE,),
            data_spec=data_spec,
            stored_spec=data_spec,
            timeouts=FAST_TIMEOUTS,
            checkpoint_dir=str(tmp_path / "owner"),
        )
    )
    owner.create(overwrite=False)
    count = 4
    owner.insert_items(
        TABLE,
        ExportedItems(
            data=[
                np.zeros([count, 2, *f["shape"]], f["dtype"])
                for f in specs.describe_spec(data_spec)
            ],
            priorities=np.ones([count]),
            times_sampled=np.zeros([count], np.int32),
        ),
    )
    yield owner
    owner.close()


def _remote(data_spec: Any, address: str, **kwargs: Any) -> RemoteBackend:
    nested = TableConfig(name=TABLE.name, capacity=TABLE.capacity, sequence_length=2)
    return RemoteBackend.from_options(
        BackendOptions(
            tables=(nested,),
            data_spec=data_spec,
            stored_spec=data_spec,
            timeouts=FAST_TIMEOUTS,
            server_address=address,
            **kwargs,
        )
    )


def test_load_takes_the_servers_layout_and_owns_no_checkpoints(data_spec: Any, server: Any):
    address = server.table_handle(TABLE).server_address
    remote = _remote(data_spec, address, layout_from_server=True)
    assert remote.checkpoint_dir is None
    assert remote.layout.name == "nested" and remote.tables[0].layout == "nested"
    client = remote.load()
    assert remote.layout.name == "packed" and remote.tables[0].layout == "packed"
    assert remote.num_items(client, TABLE.name) == 4
    assert remote.last_checkpoint() == (None, None)
    remote.close()


def test_create_refuses_a_table_with_items_unless_overwrite_then_empties_it(
    data_spec: Any, server: Any
) -> None:
    address = server.table_handle(TABLE).server_address
    remote = _remote(data_spec, address, layout_from_server=True)
    with pytest.raises(CheckpointExistsError, match=r"table 't' on .* already holds 4 items"):
        remote.create(overwrite=False)
    client = remote.create(overwrite=True)
    assert remote.num_items(client, TABLE.name) == 0
    remote.close()
