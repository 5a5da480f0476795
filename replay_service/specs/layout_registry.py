"""Which `Layout` a layout name stands for: `resolve_layout` and `as_layout`.

The names are `specs.layouts.LAYOUTS`; each maps to its implementation, `NestedLayout`
(`specs.layouts`) or the cached `PackedLayout` of a stored spec (`specs.packed.layout_of`).
The registry sits above both modules, so that neither imports the other's factory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay_service.errors import ConfigError
from replay_service.specs.framed import framed_layout_of
from replay_service.specs.layouts import NESTED, PACKED, Layout, NestedLayout, check_layout
from replay_service.specs.packed import layout_of

_MAKERS: dict[str, Callable[[Any], Layout]] = {NESTED: NestedLayout, PACKED: layout_of}


def resolve_layout(
    name: str,
    stored_spec: Any,
    where: str = "layout",
    *,
    frame_stack: int | None = None,
    frame_axis: int = 0,
) -> Layout:
    """The layout called `name` of a table storing `stored_spec` steps: a `NestedLayout`, or
    the (cached, see `packed.layout_of`) `PackedLayout` of `stored_spec`; with `frame_stack`,
    the (cached) `framed.FramedLayout` (packed, one frame per step).

    Args:
      name: "nested" or "packed".
      stored_spec: The per-step spec the table stores.
      where: What `name` is, for the error.
      frame_stack: The table's `frame_stack` (`TableConfig`); None: none.
      frame_axis: The table's `frame_axis`.

    Returns:
      The layout.

    Raises:
      ConfigError: If `name` is not a layout name, listing them, or a frame stack's layout is
        not "packed".
    """
    name = check_layout(name, where)
    if frame_stack is None:
        return _MAKERS[name](stored_spec)
    if name != PACKED:
        raise ConfigError(
            f"frame_stack={frame_stack!r} on Reverb stores one frame per step in the packed "
            f"layout, got {where}={name!r}: use layout='packed' (or 'auto')"
        )
    return framed_layout_of(stored_spec, frame_stack, frame_axis)


def as_layout(layout: Layout | str, stored_spec: Any) -> Layout:
    """`layout` itself, or the layout its name resolves to (`resolve_layout`): what the public
    constructors that take `layout=` (a name or a resolved layout) keep.

    Args:
      layout: A layout, or a layout name.
      stored_spec: The per-step spec the table stores (read only for a name).

    Returns:
      The layout.

    Raises:
      ConfigError: If `layout` is not a layout name.
    """
    if isinstance(layout, Layout):
        return layout
    return resolve_layout(layout, stored_spec)
