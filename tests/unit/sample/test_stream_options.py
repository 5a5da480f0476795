"""`stream_options`: a torch stream's options refused when it is made, each error naming the
option and its value."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

from replay_service.errors import ConfigError
from replay_service.sample.stream_options import (
    check_sizes,
    item_bytes,
    placer,
    require_flag,
    resolve_device,
    resolve_pin_memory,
)
from replay_service.specs.windows import Masked

pytestmark = pytest.mark.local


def source(sequence_length: int = 2, signature: object = None, **extra: object) -> object:
    return types.SimpleNamespace(
        table_name="t", sequence_length=sequence_length, signature=signature, **extra
    )


def test_check_sizes_returns_the_batch_size_and_refuses_bad_ones():
    assert check_sizes(np.int64(4), False, source(item_bytes=8)) == 4
    with pytest.raises(ConfigError, match="batch_size"):
        check_sizes(0, False, source(item_bytes=8))
    with pytest.raises(ConfigError, match="transitions must be True or False, got 1"):
        check_sizes(4, 1, source(item_bytes=8))


def test_transitions_need_unpadded_two_step_items():
    assert check_sizes(4, np.bool_(True), source(item_bytes=8)) == 4
    with pytest.raises(ConfigError, match="needs sequence_length=2 .*sequence_length=3"):
        check_sizes(4, True, source(3, item_bytes=8))
    with pytest.raises(ConfigError, match="padded Masked"):
        check_sizes(4, True, source(2, Masked(step=None, mask=None), item_bytes=8))


def test_item_bytes_comes_from_the_source_or_is_zero_when_unknown():
    assert item_bytes(source(item_bytes=12)) == 12
    assert item_bytes(source(signature=object())) == 0


def test_devices_and_pinning():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError):
        resolve_device("no-such-device")
    assert placer(torch.device("cpu"), False) is None
    if not torch.cuda.is_available():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_pin_memory(True) is False
        assert "no accelerator" in str(caught[0].message)
    assert resolve_pin_memory(False) is False


def test_require_flag_takes_only_bools():
    assert require_flag("drop_last", True) is True
    for value in (0, 1, np.bool_(True), "yes"):
        with pytest.raises(ConfigError, match=f"drop_last must be True or False, got {value!r}"):
            require_flag("drop_last", value)
