"""`specs.layout_registry`: which `Layout` a layout name stands for.

What each layout does with its steps is `tests/unit/specs/test_layouts.py`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from replay_service.errors import ConfigError
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import as_layout, resolve_layout
from replay_service.specs.layouts import NestedLayout
from replay_service.specs.packed import PackedLayout, layout_of
from replay_service.specs.windows import stored_spec

CARTPOLE = trajectory_spec(
    ArraySpec((4,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)


def test_resolve_layout_makes_a_new_nested_layout_of_the_stored_spec() -> None:
    first = resolve_layout("nested", CARTPOLE)
    assert type(first) is NestedLayout and first.structure is CARTPOLE
    assert resolve_layout("nested", CARTPOLE) is not first


def test_resolve_layout_caches_the_packed_layout_per_spec() -> None:
    assert type(resolve_layout("packed", CARTPOLE)) is PackedLayout
    assert resolve_layout("packed", CARTPOLE) is layout_of(CARTPOLE)
    assert resolve_layout("packed", CARTPOLE) is resolve_layout("packed", CARTPOLE)
    padded = stored_spec(CARTPOLE, True)
    assert resolve_layout("packed", padded) is not resolve_layout("packed", CARTPOLE)


@pytest.mark.parametrize("name", ["columnar", "", "Packed", None, 1])
def test_resolve_layout_refuses_an_unknown_name(name: Any) -> None:
    with pytest.raises(ConfigError, match=r"layout must be one of \['nested', 'packed'\]") as e:
        resolve_layout(name, CARTPOLE)
    assert repr(name) in str(e.value)
    with pytest.raises(ConfigError, match=r"^extra_tables\[0\]\.layout must be one of"):
        resolve_layout(name, CARTPOLE, where="extra_tables[0].layout")


def test_as_layout_keeps_a_layout_and_resolves_a_name() -> None:
    nested = NestedLayout(CARTPOLE)
    assert as_layout(nested, None) is nested  # the spec is not read for a layout
    assert as_layout("packed", CARTPOLE) is layout_of(CARTPOLE)
    assert type(as_layout("nested", CARTPOLE)) is NestedLayout
    with pytest.raises(ConfigError, match="got 'auto'"):
        as_layout("auto", CARTPOLE)
