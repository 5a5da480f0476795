"""The storage layouts, each against one table of cases (numpy only, no TensorFlow or Reverb).

Every case runs against both implementations of `specs.layouts.Layout`: what the table
describes, what a writer appends and how it reads back, and how an import chunks its writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import tree

from replay_service.specs.arrays import ArraySpec, Trajectory, trajectory_spec
from replay_service.specs.layout_registry import as_layout, resolve_layout
from replay_service.specs.layouts import LAYOUTS, Layout, NestedLayout
from replay_service.specs.packed import MAX_CHUNK_LENGTH, PackedLayout
from replay_service.specs.windows import Masked, stored_spec

# CartPole: 4 float32 observations, one int64 action: 40 bytes per step.
CARTPOLE = trajectory_spec(
    ArraySpec((4,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
CARTPOLE_FIELDS = [
    ("step_type", "int32", []),
    ("observation", "float32", [4]),
    ("action", "int64", []),
    ("next_step_type", "int32", []),
    ("reward", "float32", []),
    ("discount", "float32", []),
]
CARTPOLE_BYTES = 40


@dataclasses.dataclass(frozen=True)
class Case:
    """What one layout does with CartPole steps."""

    name: str
    kind: type[Layout]
    reverb_only: bool
    # describe(sequence_length) as (path, dtype, shape).
    described: Any
    # writer_chunking(sequence_length) -> (num_keep_alive_refs, max_chunk_length).
    chunking: Any
    mismatch_notes: list[str]
    # Columns stored per item of a table of CartPole steps.
    stored_columns: int


CASES = [
    Case(
        name="nested",
        kind=NestedLayout,
        reverb_only=False,
        described=lambda length: [
            (path, dtype, [length, *shape]) for path, dtype, shape in CARTPOLE_FIELDS
        ],
        chunking=lambda length: (length, None),
        mismatch_notes=["this manager's layout is 'nested'"],
        stored_columns=len(CARTPOLE_FIELDS),
    ),
    Case(
        name="packed",
        kind=PackedLayout,
        reverb_only=True,
        described=lambda length: [("", "uint8", [length, CARTPOLE_BYTES])],
        # 8192 bytes hold 204 CartPole steps: chunks of the maximum, 64.
        chunking=lambda length: (max(MAX_CHUNK_LENGTH, length), MAX_CHUNK_LENGTH),
        mismatch_notes=[
            "this manager's layout is 'packed': its data_spec packs a step into 40 bytes "
            "('step_type' int32[] 4 B, 'observation' float32[4] 16 B, 'action' int64[] 8 B, "
            "'next_step_type' int32[] 4 B, 'reward' float32[] 4 B, 'discount' float32[] 4 B)"
        ],
        stored_columns=1,
    ),
]
CASE_IDS = [case.name for case in CASES]


def cartpole_steps(count: int, seed: int = 0) -> list[Trajectory]:
    """`count` CartPole steps of numpy values, each field different from step to step."""
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            step_type=np.int32(i % 3),
            observation=rng.standard_normal(4).astype(np.float32),
            action=np.int64(rng.integers(0, 2)),
            policy_info=(),
            next_step_type=np.int32((i + 1) % 3),
            reward=np.float32(rng.standard_normal()),
            discount=np.float32(i % 2),
        )
        for i in range(count)
    ]


def stack(nests: list[Any]) -> Any:
    """The nests stacked leaf by leaf along a new leading dimension."""
    return tree.map_structure(lambda *leaves: np.stack(leaves), *nests)


def assert_nests_equal(actual: Any, expected: Any) -> None:
    tree.assert_same_structure(actual, expected)
    for got, want in zip(tree.flatten(actual), tree.flatten(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_every_layout_name_has_a_case() -> None:
    assert sorted(CASE_IDS) == sorted(LAYOUTS)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_resolve_layout_names_the_implementation(case: Case) -> None:
    layout = resolve_layout(case.name, CARTPOLE)
    assert type(layout) is case.kind
    assert layout.name == case.name
    assert layout.reverb_only is case.reverb_only
    assert layout.structure is CARTPOLE or layout.structure == CARTPOLE
    assert as_layout(layout, None) is layout
    assert type(as_layout(case.name, CARTPOLE)) is case.kind


@pytest.mark.parametrize("length", [1, 2, 100])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_describe_is_the_table_signature(case: Case, length: int) -> None:
    layout = resolve_layout(case.name, CARTPOLE)
    described = [(f["path"], f["dtype"], list(f["shape"])) for f in layout.describe(length)]
    assert described == case.described(length)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_mismatch_notes(case: Case) -> None:
    assert resolve_layout(case.name, CARTPOLE).mismatch_notes() == case.mismatch_notes


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_appended_steps_unpack_to_the_same_nest(case: Case) -> None:
    layout = resolve_layout(case.name, CARTPOLE)
    steps = cartpole_steps(5)
    stored = stack([layout.encode_step(step) for step in steps])
    assert_nests_equal(layout.unpack(stored), stack(steps))
    # A batch of items (leading dimensions batch, time) unpacks the same way.
    batch = stack(
        [tree.map_structure(lambda x: x[:3], stored), tree.map_structure(lambda x: x[2:], stored)]
    )
    assert_nests_equal(layout.unpack(batch), stack([stack(steps[:3]), stack(steps[2:])]))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_padded_steps_unpack_to_the_same_masked_nest(case: Case) -> None:
    layout = resolve_layout(case.name, stored_spec(CARTPOLE, True))
    steps = [Masked(step, np.bool_(i < 2)) for i, step in enumerate(cartpole_steps(3))]
    stored = stack([layout.encode_step(step) for step in steps])
    back = layout.unpack(stored)
    assert_nests_equal(back, stack(steps))
    np.testing.assert_array_equal(back.mask, [True, True, False])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_exported_columns_round_trip(case: Case) -> None:
    layout = resolve_layout(case.name, CARTPOLE)
    steps = cartpole_steps(12, seed=1)
    items = [stack(steps[i : i + 3]) for i in range(0, 12, 3)]  # 4 items of 3 steps
    columns = [np.stack(leaves) for leaves in zip(*map(tree.flatten, items), strict=True)]
    stored = layout.encode_columns(columns)
    assert len(stored) == case.stored_columns
    assert all(column.shape[:2] == (4, 3) for column in stored)
    back = layout.decode_columns(stored)
    assert len(back) == len(columns)
    for got, want in zip(back, columns, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    copies = layout.decode_columns(stored, copy=True)
    for copy in copies:
        assert copy.flags.c_contiguous
    expected = [column.copy() for column in columns]
    for column in stored:
        column[...] = 0  # the copies are arrays of their own
    for got, want in zip(copies, expected, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 500])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_export_chunking(case: Case, length: int) -> None:
    layout = resolve_layout(case.name, CARTPOLE)
    assert layout.writer_chunking(length) == case.chunking(length)


def test_packed_chunks_of_big_steps_hold_about_8192_bytes() -> None:
    image = trajectory_spec(
        ArraySpec((64, 64, 3), np.uint8, "observation"), ArraySpec((), np.int64, "action")
    )
    layout = resolve_layout("packed", image)
    assert layout.writer_chunking(2) == (2, 1)  # 12,312 bytes per step: one step per chunk
    assert resolve_layout("nested", image).writer_chunking(2) == (2, None)


def test_packed_encode_step_names_the_wrong_field() -> None:
    layout = resolve_layout("packed", CARTPOLE)
    step = cartpole_steps(1)[0]
    assert np.array_equal(layout.encode_step(tree.flatten(step)), layout.encode_step(step))
    with pytest.raises(ValueError, match=r"'observation': expected float32\[4\], got float64"):
        layout.encode_step(step._replace(observation=np.zeros(4)))
    with pytest.raises(ValueError, match="has 6 fields, got 5"):
        layout.encode_step(tree.flatten(step)[:5])
    with pytest.raises(ValueError, match=r"one column, got 2"):
        layout.decode_columns([np.zeros([1, 2, 40], np.uint8)] * 2)


@pytest.mark.parametrize(
    ("name", "max_step_bytes", "reads_rows"),
    [
        ("nested", 4096, False),
        ("packed", 4096, True),
        ("packed", CARTPOLE_BYTES, True),
        ("packed", CARTPOLE_BYTES - 1, False),
    ],
)
def test_batch_reader_unpacks_small_packed_steps_itself(
    name: str, max_step_bytes: int, reads_rows: bool
) -> None:
    layout = resolve_layout(name, CARTPOLE)
    given: list[Layout] = []

    def read_nest(flat: Any) -> str:
        return "nest"

    def rows_reader(rows_layout: PackedLayout) -> Any:
        given.append(rows_layout)
        return lambda flat: "rows"

    read, unpack = layout.batch_reader(max_step_bytes, read_nest, rows_reader)
    assert read(None) == ("rows" if reads_rows else "nest")
    assert unpack is not reads_rows  # the pipeline unpacks whatever the reader does not
    assert given == ([layout] if reads_rows else [])


def test_nested_reading_leaves_items_as_they_are() -> None:
    layout = resolve_layout("nested", CARTPOLE)
    item = stack(cartpole_steps(2))
    assert layout.unpack(item) is item
    assert layout.step_spec() is CARTPOLE
