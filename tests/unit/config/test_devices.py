"""`config.devices`: the devices a `device=` option may name, checked where it is given."""

from __future__ import annotations

import pytest
import torch

from replay_service.config import devices
from replay_service.config.devices import available_devices, require_device
from replay_service.errors import ConfigError


@pytest.fixture()
def accelerators(monkeypatch):
    """Makes this machine have the given count of each accelerator kind."""

    def set_counts(**counts):
        monkeypatch.setattr(devices, "_count", lambda kind: counts.get(kind, 0))

    return set_counts


def test_the_cpu_comes_first_then_each_accelerator_by_index(accelerators):
    accelerators()
    assert available_devices() == ["cpu"]
    accelerators(cuda=2, mps=1, xpu=1)
    assert available_devices() == ["cpu", "cuda:0", "cuda:1", "xpu:0", "mps"]


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_the_cpu_is_always_there(device, accelerators):
    accelerators()
    assert require_device(device) == torch.device(device)


def test_an_accelerator_here_is_kept_as_given(accelerators):
    accelerators(cuda=2)
    assert require_device("cuda") == torch.device("cuda")
    assert require_device("cuda").index is None
    assert require_device("cuda:1") == torch.device("cuda", 1)


def test_an_index_beyond_the_devices_here_is_refused(accelerators):
    accelerators(cuda=1)
    with pytest.raises(ConfigError) as raised:
        require_device("cuda:3", "storage_device")
    assert str(raised.value) == (
        "storage_device='cuda:3': this machine has 1 'cuda' device; available here: "
        "['cpu', 'cuda:0']"
    )
    accelerators(cuda=2)
    with pytest.raises(ConfigError, match="has 2 'cuda' devices;"):
        require_device("cuda:2")


def test_a_kind_not_here_is_refused_naming_it_and_the_devices_here(accelerators):
    accelerators()
    with pytest.raises(ConfigError) as raised:
        require_device("mps")
    assert str(raised.value) == (
        "device='mps' was asked for, but MPS is not available here; available here: ['cpu']"
    )
    with pytest.raises(ConfigError, match="device='ipu' was asked for, but 'ipu' is not"):
        require_device("ipu")


def test_meta_and_what_is_no_device_are_refused(accelerators):
    accelerators()
    with pytest.raises(ConfigError, match="device='meta': 'meta' tensors hold no data"):
        require_device("meta")
    with pytest.raises(ConfigError) as raised:
        require_device("gpu0")
    assert str(raised.value) == (
        "device must be a torch device such as 'cpu' or 'cuda:0', got 'gpu0'; available here: "
        "['cpu']"
    )
    with pytest.raises(ConfigError, match="got None"):
        require_device(None)


def test_kinds_restrict_the_devices_allowed(accelerators):
    accelerators(mps=1)
    assert require_device("mps", kinds=("cpu", "mps")) == torch.device("mps")
    with pytest.raises(ConfigError) as raised:
        require_device("mps", "device", kinds=("cpu", "cuda"))
    assert str(raised.value) == (
        "device='mps': a device of kind ('cpu', 'cuda') is needed here, not 'mps'; available "
        "here: ['cpu', 'mps']"
    )


def test_count_is_zero_for_a_kind_this_torch_lacks_or_cannot_query(monkeypatch):
    assert devices._count("no_such_kind") == 0

    class Broken:
        @staticmethod
        def is_available():
            raise RuntimeError("not compiled with this backend")

    class One:
        @staticmethod
        def is_available():
            return True

    monkeypatch.setattr(torch, "xpu", Broken, raising=False)
    assert devices._count("xpu") == 0
    monkeypatch.setattr(torch, "mps", One, raising=False)
    assert devices._count("mps") == 1  # no device_count: one device
