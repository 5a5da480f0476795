"""`backends.base`: the refusals of a backend that lacks a capability, the check of a manager's
backend options, and the lifeline shared with the streams."""

from __future__ import annotations

from typing import ClassVar

import pytest

from replay_service.backends.base import Backend, Capability, Lifeline
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError


class _PortOnly(Backend):
    """A backend whose only capability beyond the interface is a listening port."""

    description: ClassVar[str] = "the port-only backend"
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.PORT})

    @classmethod
    def from_options(cls, options: object) -> Backend:  # type: ignore[override]
        raise NotImplementedError


def test_the_lifeline_counts_clears_and_closes_once_for_all() -> None:
    lifeline = Lifeline()
    assert (lifeline.closed, lifeline.clears) == (False, 0)
    lifeline.cleared()
    lifeline.cleared()
    lifeline.close()
    assert (lifeline.closed, lifeline.clears) == (True, 2)


def test_a_refusal_names_the_value_the_backend_and_the_way_out() -> None:
    error = _PortOnly.refusal(Capability.MIXED_DATASET, "mixed_dataset({'a': 1})")
    assert isinstance(error, ConfigError)
    assert str(error) == (
        "mixed_dataset({'a': 1}): mixed_dataset is not available with the port-only backend; "
        "choose another backend (ReplayBufferManager's backend argument)"
    )


def test_require_passes_a_capability_the_backend_has_and_refuses_others() -> None:
    _PortOnly.require(Capability.PORT, "port=1234")
    with pytest.raises(ConfigError, match=r"seed=3: seed= \(reproducible"):
        _PortOnly.require(Capability.SEEDED_SAMPLING, "seed=3")


def test_options_that_ask_nothing_extra_are_not_refused() -> None:
    quiet = {"storage": "memory", "layout": "auto", "port": None, "seed": None, "device": None}
    assert _PortOnly.refused_options(quiet) == []
    _PortOnly.check_options(quiet)
    assert _PortOnly.refused_options({"layout": "nested", "port": 80}) == []


def test_refused_options_are_listed_in_the_order_they_are_checked() -> None:
    options = {"device": "cpu", "seed": 1, "port": 80, "layout": "packed", "storage": "memmap"}
    assert _PortOnly.refused_options(options) == ["storage", "layout", "seed", "device"]
    with pytest.raises(ConfigError, match=r"^storage='memmap': storage='memmap' \(tables"):
        _PortOnly.check_options(options)
    with pytest.raises(ConfigError, match=r"^device='cpu': device="):
        _PortOnly.check_options({"device": "cpu"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"storage": "disk"}, "storage must be 'memory' or 'memmap', got 'disk'"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_bad_option_values_are_refused_before_capabilities(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _PortOnly.check_options(options)


def test_recent_sampling_is_refused_where_the_backend_lacks_it() -> None:
    table = TableConfig(name="t", capacity=4)
    # `newest_reader` reads only the class's capabilities and refusal.
    with pytest.raises(ConfigError, match=r"recent_batches\(8\): recent_batches"):
        Backend.newest_reader(_PortOnly, table, "recent_batches(8)")  # type: ignore[arg-type]
