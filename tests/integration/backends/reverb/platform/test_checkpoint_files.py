"""Reverb's checkpoint files read to their end: items counted, files hashed, and a missing
`DONE`, a truncated, damaged or overlong file named; their records read back as written."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import reverb

from replay_service.backends.reverb.platform.checkpoint_files import (
    CHECKPOINT_FORMAT,
    CHUNKS_FILE,
    DATA_FILES,
    ITEMS_FILE,
    TABLES_FILE,
    is_reverb_checkpoint,
    iter_records,
    read_records,
    verify_files,
)
from replay_service.errors import CheckpointError, NotRegularFileError
from replay_service.storage.files import DONE_FILE

ITEMS = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Reverb checkpoint of two tables: 7 items of one int32 each in `a`, 2 in `b`."""
    root = tmp_path_factory.mktemp("reverb")
    server = reverb.Server(
        [reverb.Table.queue("a", 100), reverb.Table.queue("b", 100)],
        checkpointer=reverb.checkpointers.DefaultCheckpointer(str(root)),
    )
    try:
        client = reverb.Client(f"localhost:{server.port}")
        for i in range(ITEMS):
            client.insert([np.int32(i)], {"a": 1.0})
        client.insert([np.int32(-1)], {"b": 1.0})
        client.insert([np.int32(-2)], {"b": 1.0})
        return client.checkpoint()
    finally:
        server.stop()


@pytest.fixture()
def copy(checkpoint: str, tmp_path: Path) -> Path:
    """A copy of the checkpoint to damage."""
    return Path(shutil.copytree(checkpoint, tmp_path / "copy"))


def test_verify_counts_every_tables_items_and_hashes_every_file(checkpoint: str) -> None:
    assert is_reverb_checkpoint(checkpoint)
    items, files = verify_files(checkpoint)
    assert items == ITEMS + 2
    assert set(files) == set(DATA_FILES)
    assert files[TABLES_FILE]["records"] == 2
    assert files[CHUNKS_FILE]["records"] >= 1
    for name, info in files.items():
        data = Path(checkpoint, name).read_bytes()
        assert info["size"] == len(data)
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert CHECKPOINT_FORMAT.verify(checkpoint) == (items, files)


@pytest.mark.heavy
def test_records_are_read_whole_and_the_same_as_a_stream(checkpoint: str) -> None:
    records = read_records(checkpoint, ITEMS_FILE)
    assert len(records) == ITEMS + 2
    assert list(iter_records(checkpoint, ITEMS_FILE)) == records


def test_a_checkpoint_without_done_is_incomplete(copy: Path) -> None:
    (copy / DONE_FILE).unlink()
    assert not is_reverb_checkpoint(str(copy))
    with pytest.raises(CheckpointError, match=rf"{copy}.* is incomplete \(no DONE file\)"):
        verify_files(str(copy))


def test_a_missing_data_file_is_named(copy: Path) -> None:
    (copy / CHUNKS_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"cannot read '{copy / CHUNKS_FILE}'"):
        verify_files(str(copy))


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_a_truncated_file_is_named_with_its_size(copy: Path, keep: float) -> None:
    path = copy / ITEMS_FILE
    size = int(path.stat().st_size * keep)
    os.truncate(path, size)
    with pytest.raises(CheckpointError, match=rf"'{path}' is truncated \({size} bytes"):
        verify_files(str(copy))


def test_damaged_bytes_are_named(copy: Path) -> None:
    path = copy / ITEMS_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"'{path}' is (damaged|truncated)"):
        verify_files(str(copy))


def test_bytes_after_the_zlib_stream_are_refused(copy: Path) -> None:
    path = copy / TABLES_FILE
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match=rf"'{path}' has data after the end of its ZLIB"):
        verify_files(str(copy))


def test_a_named_pipe_in_place_of_a_record_file_is_never_opened(copy: Path) -> None:
    path = copy / ITEMS_FILE
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(NotRegularFileError, match=str(path)):
        read_records(str(copy), ITEMS_FILE)
    with pytest.raises(NotRegularFileError, match=str(path)):
        list(iter_records(str(copy), ITEMS_FILE))


def test_records_of_an_unreadable_file_are_a_checkpoint_error(copy: Path) -> None:
    (copy / ITEMS_FILE).write_bytes(b"not zlib")
    with pytest.raises(CheckpointError, match=rf"cannot read '{copy / ITEMS_FILE}' of"):
        read_records(str(copy), ITEMS_FILE)


def test_the_format_owns_directories_with_tfrecord_files() -> None:
    assert CHECKPOINT_FORMAT.owns([DONE_FILE, ITEMS_FILE])
    assert not CHECKPOINT_FORMAT.owns([DONE_FILE, "state.safetensors"])
