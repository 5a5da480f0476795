"""The small helpers every part shares: integer checks, numpy conversion, durable writes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_service.config.options import INT32_MAX, require_int, require_positive_int
from replay_service.errors import ConfigError
from replay_service.specs.arrays import is_tf_tensor, is_torch_tensor, to_numpy
from replay_service.storage.file_modes import (
    FILE_MODE,
    fsync_tree,
    write_json_atomic,
    write_synced,
)


@pytest.mark.parametrize("value", [0, -3, True, False, 2.5, "4", None])
def test_require_positive_int_names_the_option_and_the_value(value):
    with pytest.raises(ConfigError) as raised:
        require_positive_int("batch_size", value)
    assert str(raised.value) == f"batch_size must be a positive integer, got {value!r}"


def test_require_positive_int_caps_at_int32_unless_told_otherwise():
    assert require_positive_int("capacity", INT32_MAX) == INT32_MAX
    with pytest.raises(ConfigError, match=r"capacity must be an integer in 1\.\.2147483647"):
        require_positive_int("capacity", INT32_MAX + 1)
    assert require_positive_int("batch_size", 2**40, maximum=None) == 2**40
    assert require_int("prefetch", 0, 0, maximum=None) == 0
    with pytest.raises(ConfigError, match="prefetch must be an integer >= 0, got -1"):
        require_int("prefetch", -1, 0, maximum=None)


def test_to_numpy_converts_numpy_torch_and_python_values():
    array = np.arange(3, dtype=np.float32)
    assert to_numpy(array) is array
    tensor = torch.arange(3, dtype=torch.float32, requires_grad=True) * 2
    converted = to_numpy(tensor)
    assert type(converted) is np.ndarray
    np.testing.assert_array_equal(converted, [0.0, 2.0, 4.0])
    assert is_torch_tensor(tensor) and not is_torch_tensor(array)
    assert not is_tf_tensor(tensor) and not is_tf_tensor(array)
    np.testing.assert_array_equal(to_numpy([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]]))


def test_write_json_atomic_replaces_the_file_or_leaves_it_as_it_was(tmp_path):
    path = str(tmp_path / "meta.json")
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert json.loads(Path(path).read_text(encoding="utf-8")) == {"a": [1, 2], "b": 1}
    assert stat.S_IMODE(os.stat(path).st_mode) == FILE_MODE
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(Path(path).read_text(encoding="utf-8")) == {"a": [1, 2], "b": 1}
    assert sorted(os.listdir(tmp_path)) == ["meta.json"], "the temporary file is removed"


def test_write_synced_and_fsync_tree(tmp_path):
    (tmp_path / "sub").mkdir()
    path = str(tmp_path / "sub" / "DONE")
    write_synced(path, "done\n")
    assert Path(path).read_text(encoding="utf-8") == "done\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == FILE_MODE
    fsync_tree(str(tmp_path))  # every file and directory opens and syncs
    with pytest.raises(OSError):
        write_synced(str(tmp_path / "missing" / "DONE"), "")
