"""An export's state file at the byte level: written as safetensors writes it, mapped back."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from replay_service.errors import CheckpointError, UnknownFormatError
from replay_service.storage import formats
from replay_service.storage.export_state import (
    Concatenated,
    check_header_tag,
    mapped_state,
    write_safetensors,
)

pytestmark = pytest.mark.local

TAG = {"format": formats.EXPORT.tag}


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "data/x": rng.random((4, 2, 3)).astype(np.float32),
        "priorities": rng.random(4),
        "times_sampled": np.arange(4, dtype=np.int32),
    }


def _write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    with open(path, "wb") as f:
        return write_safetensors(f, tensors, metadata)


def test_a_written_file_maps_back_as_views_of_the_same_tensors(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    tensors = _tensors()
    digest = _write(path, tensors, TAG)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with mapped_state(str(path), digest) as views:
        assert sorted(views) == sorted(tensors)
        for name, array in tensors.items():
            assert not views[name].flags.writeable
            np.testing.assert_array_equal(views[name], array)


def test_parts_written_as_one_tensor_give_the_bytes_of_the_joined_array() -> None:
    tensors = _tensors()
    joined = io.BytesIO()
    write_safetensors(joined, tensors, TAG)
    x = tensors["data/x"]
    split = {**tensors, "data/x": Concatenated((x[:1], x[1:3], x[3:]))}
    parts = io.BytesIO()
    write_safetensors(parts, split, TAG)
    assert parts.getvalue() == joined.getvalue() == safetensors.numpy.save(tensors, TAG)
    assert split["data/x"].shape == x.shape and split["data/x"].nbytes == x.nbytes


def test_a_mapped_file_whose_digest_differs_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    digest = _write(path, _tensors(), TAG)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    refused = pytest.raises(CheckpointError, match=f"its sha256 is {actual}.*records {digest}")
    with refused, mapped_state(str(path), digest):
        pass


def test_a_missing_empty_or_cut_state_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    with pytest.raises(CheckpointError, match="does not exist"), mapped_state(str(path), "0"):
        pass
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"), mapped_state(str(path), "0"):
        pass
    _write(path, _tensors(), TAG)
    path.write_bytes(path.read_bytes()[:-5])
    cut = pytest.raises(CheckpointError, match="does not fit the file")
    with cut, mapped_state(str(path), "0"):
        pass


def test_a_state_file_of_a_newer_format_is_refused_not_read(tmp_path: Path) -> None:
    newer = {"format": f"{formats.EXPORT.tag.rsplit('/', 1)[0]}/99"}
    path = tmp_path / "state.safetensors"
    digest = _write(path, _tensors(), newer)
    with pytest.raises(UnknownFormatError), mapped_state(str(path), digest):
        pass
    with pytest.raises(UnknownFormatError, match="'header'"):
        check_header_tag({"__metadata__": newer}, "'header'")
    with pytest.raises(CheckpointError, match="no format tag"):
        check_header_tag({"__metadata__": {}}, "'header'")
    check_header_tag({"__metadata__": dict(TAG)}, "'header'")
