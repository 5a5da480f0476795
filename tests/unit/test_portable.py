"""What runs without TensorFlow, TF-Agents and Reverb: specs, exports, the lock, torch batches.

Tests marked `local` import none of them and also run under Python 3.12 (`pytest -m local`);
the TF/ArraySpec comparisons skip where TF-Agents is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tree

from replay_service.config.options import TableConfig
from replay_service.errors import (
    CheckpointError,
    ConfigError,
    SpecMismatchError,
)
from replay_service.specs import arrays as array_specs
from replay_service.specs import nests as specs
from replay_service.specs.arrays import ArraySpec, StepType, Trajectory
from replay_service.storage.directory import LOCK_FILE
from replay_service.storage.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
REFUSED = ("tensorflow", "tf_agents", "reverb")
TF_FREE_MODULES = (
    "backends",
    "backends.base",
    "backends.local.backend",
    "backends.local.client",
    "backends.reverb.connection",
    "backends.reverb.handles",
    "backends.reverb.torch_source",
    "cli.output",
    "collect.gym_vector",
    "config",
    "errors",
    "monitoring.stats",
    "sample.batches",
    "sample.nstep",
    "sample.priorities",
    "sample.torch_dataset",
    "sample.torch_streams",
    "specs",
    "specs.arrays",
    "specs.windows",
    "storage.export",
    "storage.store",
)
SPACE_KINDS = ("box", "discrete", "multi_discrete", "multi_binary", "dict", "tuple")


def spaces_cases() -> dict[str, tuple[Any, Any]]:
    """Observation and action spaces of every supported kind."""
    from gymnasium import spaces

    return {
        "box": (spaces.Box(-1, 1, (3, 2)), spaces.Box(-1, 1, (2, 2), np.float64)),
        "discrete": (spaces.Discrete(5), spaces.Discrete(3)),
        "multi_discrete": (spaces.MultiDiscrete([3, 4]), spaces.MultiDiscrete([2, 2, 2])),
        "multi_binary": (spaces.MultiBinary(4), spaces.MultiBinary([2, 3])),
        "dict": (
            spaces.Dict(
                {"pos": spaces.Box(0, 1, (2,)), "goal": spaces.Dict({"id": spaces.Discrete(2)})}
            ),
            spaces.Dict({"move": spaces.Box(-1, 1, (2,)), "grip": spaces.Discrete(2)}),
        ),
        "tuple": (
            spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 255, (3,), np.uint8))),
            spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(2))),
        ),
    }


# ------------------------------------------------------------------- no TF in the process


_NO_TF_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, os, sys, tempfile

    REFUSED = {refused!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ImportError(f"{{name}} is refused in this test")
            return None

    sys.meta_path.insert(0, Refuse())

    import numpy as np
    from gymnasium import spaces

    import replay_service
    for module in {modules!r}:
        importlib.import_module(f"replay_service.{{module}}")
    assert "ArraySpec" in dir(replay_service) and "ReplayBufferManager" in dir(replay_service)

    from replay_service.specs import arrays as array_specs
    from replay_service.storage import export, importing
    from replay_service.specs import nests as specs
    from replay_service.specs import windows as sequences
    from replay_service.storage.store import CheckpointStore
    from replay_service.config.options import TableConfig
    from replay_service.errors import CheckpointError

    spec = replay_service.data_spec_for_spaces(spaces.Box(-1, 1, (3,)), spaces.Discrete(4))
    assert isinstance(spec, array_specs.Trajectory), type(spec)
    assert spec == array_specs.spec_for_spaces(spaces.Box(-1, 1, (3,)), spaces.Discrete(4))
    fields = specs.describe_spec(spec)
    assert [f["path"] for f in fields] == [
        "step_type", "observation", "action", "next_step_type", "reward", "discount"
    ], fields
    assert specs.spec_from_description(fields) == spec
    assert specs.check_collect_spec(spec, "test") == spec
    stored = sequences.stored_spec(spec, True)
    assert sequences.padding_step(spec).mask == np.False_

    root = tempfile.mkdtemp()
    table = TableConfig(name="t", capacity=10, sequence_length=2)
    items = export.ExportedItems(
        data=[
            np.zeros([3, 2, *f["shape"]], f["dtype"])
            for f in specs.describe_spec(stored)
        ],
        priorities=np.ones([3]),
        times_sampled=np.zeros([3], np.int32),
    )
    export.write_export(os.path.join(root, "x"), "b_", table, stored, items, False)
    back = importing.read_export(table, stored, os.path.join(root, "x"), "b_")
    assert back.num_items == 3

    first = CheckpointStore(os.path.join(root, "ckpt"))
    first.lock()
    try:
        CheckpointStore(os.path.join(root, "ckpt")).lock()
    except CheckpointError as e:
        assert "in use" in str(e), e
    else:
        raise AssertionError("a second lock was granted")
    first.unlock()

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
    assert not loaded, loaded
    print("TF-free: ok")
    """
)


@pytest.mark.local
def test_the_portable_modules_import_and_work_without_tensorflow_tf_agents_or_reverb() -> None:
    pytest.importorskip("gymnasium")
    script = _NO_TF_SCRIPT.format(refused=REFUSED, modules=TF_FREE_MODULES)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TF-free: ok" in result.stdout


@pytest.mark.local
def test_import_replay_service_is_lazy_and_dir_lists_every_public_name() -> None:
    import replay_service

    assert set(replay_service.__all__) <= set(dir(replay_service))
    assert replay_service.ArraySpec is ArraySpec
    assert replay_service.data_spec_for_spaces is specs.data_spec_for_spaces
    with pytest.raises(AttributeError, match="no_such_name"):
        replay_service.no_such_name  # noqa: B018


# ------------------------------------------------------------------------------ ArraySpec


@pytest.mark.local
def test_array_spec_normalizes_its_dtype_and_shape_and_is_a_tree_leaf() -> None:
    spec = ArraySpec([2, np.int64(3)], "float32", "obs")
    assert spec.shape == (2, 3) and spec.dtype == np.dtype(np.float32)
    assert spec == ArraySpec((2, 3), np.float32, "obs") and hash(spec) == hash(
        ArraySpec((2, 3), np.float32, "obs")
    )
    assert not spec.is_bounded and spec.zeros().shape == (2, 3)
    assert tree.flatten({"a": spec}) == [spec]
    bounded = ArraySpec((2,), np.int64, "a", minimum=0, maximum=[3, 4])
    assert bounded.is_bounded and bounded == ArraySpec((2,), np.int64, "a", 0, [3, 4])
    assert bounded != ArraySpec((2,), np.int64, "a", 0, [3, 5])


@pytest.mark.local
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": (2, -1), "dtype": np.float32}, r"non-negative ints, got \(2, -1\)"),
        ({"shape": (2.5,), "dtype": np.float32}, r"got \(2\.5,\)"),
        ({"shape": "ab", "dtype": np.float32}, "got 'ab'"),
        ({"shape": (2,), "dtype": "no_such_dtype"}, "'no_such_dtype' is not a numpy dtype"),
        ({"shape": (2,), "dtype": None}, "dtype is required"),
        ({"shape": (2,), "dtype": object}, "numeric or bool"),
        ({"shape": (2,), "dtype": np.float32, "name": 3}, "name must be a str or None, got 3"),
        ({"shape": (2,), "dtype": np.float32, "minimum": [1, 2, 3]}, r"minimum \[1, 2, 3\]"),
    ],
)
def test_array_spec_refuses_bad_values_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecMismatchError, match=match):
        ArraySpec(**kwargs)


@pytest.mark.local
def test_trajectory_has_tf_agents_fields_and_step_types() -> None:
    assert Trajectory._fields == (
        "step_type",
        "observation",
        "action",
        "policy_info",
        "next_step_type",
        "reward",
        "discount",
    )
    assert (StepType.FIRST, StepType.MID, StepType.LAST) == (0, 1, 2)


# ------------------------------------------------------------------- specs from spaces


@pytest.mark.local
@pytest.mark.parametrize("kind", SPACE_KINDS)
def test_spec_for_spaces_builds_sb3_shapes_and_dtypes(kind: str) -> None:
    pytest.importorskip("gymnasium")
    observation_space, action_space = spaces_cases()[kind]
    spec = array_specs.spec_for_spaces(observation_space, action_space)
    assert isinstance(spec, Trajectory) and spec.policy_info == ()
    assert spec.reward == ArraySpec((), np.float32, "reward")
    assert spec.step_type == ArraySpec((), np.int32, "step_type")
    described = {f["path"]: (f["dtype"], f["shape"]) for f in specs.describe_spec(spec)}
    expected = {
        "box": {"observation": ("float32", [3, 2]), "action": ("float32", [4])},
        "discrete": {"observation": ("int64", [1]), "action": ("int64", [1])},
        "multi_discrete": {"observation": ("int64", [2]), "action": ("int64", [3])},
        "multi_binary": {"observation": ("int8", [4]), "action": ("int8", [6])},
        "dict": {
            "observation/goal/id": ("int64", [1]),
            "observation/pos": ("float32", [2]),
            "action/grip": ("int64", [1]),
            "action/move": ("float32", [2]),
        },
        "tuple": {
            "observation/0": ("int64", [1]),
            "observation/1": ("uint8", [3]),
            "action/0": ("int64", [1]),
            "action/1": ("int8", [2]),
        },
    }[kind]
    assert {k: v for k, v in described.items() if k in expected} == expected


@pytest.mark.local
def test_an_unsupported_space_is_refused_naming_it() -> None:
    spaces = pytest.importorskip("gymnasium.spaces")
    with pytest.raises(ConfigError, match="observation space 'observation'.*Text"):
        array_specs.spec_for_spaces(spaces.Text(5), spaces.Discrete(2))
    with pytest.raises(ConfigError, match="empty"):
        array_specs.spec_for_spaces(spaces.Box(0, 1, (2,)), spaces.Dict({}))


@pytest.mark.parametrize("kind", SPACE_KINDS)
def test_tf_and_array_specs_of_every_space_kind_describe_equally(kind: str) -> None:
    pytest.importorskip("tf_agents")
    from tf_agents.trajectories import trajectory

    observation_space, action_space = spaces_cases()[kind]
    tf_spec = specs.data_spec_for_spaces(observation_space, action_space, spec_type="tf")
    array_spec = array_specs.spec_for_spaces(observation_space, action_space)
    assert isinstance(tf_spec, trajectory.Trajectory)
    assert specs.data_spec_for_spaces(observation_space, action_space) == tf_spec  # auto
    assert specs.describe_spec(tf_spec) == specs.describe_spec(array_spec)
    assert specs.to_array_spec(tf_spec) == array_spec
    assert specs.describe_spec(specs.to_tf_spec(array_spec)) == specs.describe_spec(tf_spec)
    fields = specs.describe_spec(array_spec)
    assert specs.describe_spec(specs.spec_from_description(fields, spec_type="tf")) == fields
    assert specs.describe_spec(specs.spec_from_description(fields, spec_type="array")) == fields
    assert specs.describe_spec(specs.check_collect_spec(array_spec, "test")) == fields


def test_tf_and_array_specs_find_the_same_value_mismatches() -> None:
    pytest.importorskip("tf_agents")
    from gymnasium import spaces

    array_spec = array_specs.spec_for_spaces(spaces.Box(-1, 1, (3,)), spaces.Discrete(2))
    tf_spec = specs.to_tf_spec(array_spec)
    value = Trajectory(
        np.int32(0), np.zeros(3, np.float32), np.zeros(2, np.int64), (), np.int32(1), 0.5, 1.0
    )
    assert (
        specs.diff_value(value, array_spec)
        == specs.diff_value(value, tf_spec)
        == [
            "field 'action': expected int64[1], got int64[2]",
            "field 'reward': expected float32[], got float64[]",
            "field 'discount': expected float32[], got float64[]",
        ]
    )


# ------------------------------------------------------------------------- specs helpers


@pytest.mark.local
def test_specs_helpers_take_array_specs() -> None:
    spec = array_specs.trajectory_spec(
        observation={"x": ArraySpec((3,), np.float32, "x")}, action=ArraySpec((1,), np.int64)
    )
    value = Trajectory(
        np.int32(0),
        {"x": np.zeros(3, np.float32)},
        np.zeros(1, np.int64),
        (),
        np.int32(1),
        np.float32(0),
        np.float32(1),
    )
    assert specs.diff_value(value, spec) == []
    assert specs.diff_value(value._replace(observation={"x": np.zeros(2)}), spec) == [
        "field 'observation/x': expected float32[3], got float64[2]"
    ]
    assert specs.diff_value(value._replace(observation=np.zeros(3)), spec)[0].startswith(
        "structure differs"
    )
    assert specs.normalize_spec(ArraySpec((2,), np.int8, "b", 0, 1)) == ArraySpec(
        (2,), np.int8, "b"
    )
    assert specs.check_collect_spec(spec, "test") == spec
    with pytest.raises(SpecMismatchError, match=r"needs a TF-Agents Trajectory.*got a dict"):
        specs.check_collect_spec({"x": ArraySpec((1,), np.float32)}, "test")
    with pytest.raises(SpecMismatchError, match="'a' is not a TensorSpec or ArraySpec: 3"):
        specs.describe_spec({"a": 3})
    with pytest.raises(ConfigError, match="spec_type must be one of"):
        specs.spec_from_description(specs.describe_spec(spec), spec_type="torch")  # type: ignore[arg-type]


@pytest.mark.local
def test_padded_tables_store_masked_array_specs() -> None:
    from replay_service.specs import windows as sequences

    spec = array_specs.trajectory_spec(ArraySpec((2,), np.float32), ArraySpec((1,), np.int64))
    stored = sequences.stored_spec(spec, True)
    assert stored.mask == ArraySpec((), np.bool_, "mask")
    padding = sequences.padding_step(spec)
    assert padding.mask == np.False_ and padding.step.observation.dtype == np.float32
    assert specs.diff_value(padding, stored) == []


# --------------------------------------------------------------------------------- export


def _stored_and_items(count: int) -> tuple[Any, Any]:
    from replay_service.specs import windows as sequences
    from replay_service.storage import export

    spec = array_specs.trajectory_spec(
        {"x": ArraySpec((3,), np.float32)}, ArraySpec((1,), np.int64)
    )
    stored = sequences.stored_spec(spec, True)
    rng = np.random.default_rng(0)
    items = export.ExportedItems(
        data=[
            (rng.random([count, 2, *f["shape"]]) * 5).astype(f["dtype"])
            for f in specs.describe_spec(stored)
        ],
        priorities=rng.random([count]),
        times_sampled=np.arange(count, dtype=np.int32),
    )
    return stored, items


@pytest.mark.local
def test_write_export_and_read_export_round_trip_without_tf(tmp_path: Path) -> None:
    from replay_service.storage import export, export_target, importing

    stored, items = _stored_and_items(4)
    table = TableConfig(name="t", capacity=10, sequence_length=2)
    state_path, metadata_path = export.write_export(tmp_path / "e", "p_", table, stored, items)
    assert (state_path, metadata_path) == export_target.export_paths(tmp_path / "e", "p_")
    metadata = export.read_metadata(metadata_path)
    assert metadata["data_spec"] == specs.describe_spec(stored)
    assert metadata["versions"]["replay_service"]
    back = importing.read_export(table, stored, tmp_path / "e", "p_")
    for got, want in zip(back.data, items.data, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(back.priorities, items.priorities)
    np.testing.assert_array_equal(back.times_sampled, items.times_sampled)
    fields = export.item_fields(stored, 2)
    assert export.read_state_fields(state_path, fields, 4).num_items == 4
    with pytest.raises(CheckpointError, match="not empty"):
        export.write_export(tmp_path / "e", "p_", table, stored, items)
    export.write_export(tmp_path / "e", "p_", table, stored, items.newest(2), overwrite=True)
    assert importing.read_export(table, stored, tmp_path / "e", "p_").num_items == 2


@pytest.mark.local
def test_write_export_refuses_items_that_do_not_match_the_spec(tmp_path: Path) -> None:
    from replay_service.storage import export

    stored, items = _stored_and_items(3)
    table = TableConfig(name="t", capacity=10, sequence_length=2)
    bad = export.ExportedItems(
        data=[items.data[0].astype(np.float64), *items.data[1:]],
        priorities=items.priorities,
        times_sampled=items.times_sampled,
    )
    with pytest.raises(SpecMismatchError, match="exported field 'step/step_type'"):
        export.write_export(tmp_path, "p_", table, stored, bad)
    with pytest.raises(SpecMismatchError, match="data arrays"):
        export.write_export(
            tmp_path,
            "p_",
            table,
            stored,
            export.ExportedItems(
                data=items.data[1:], priorities=items.priorities, times_sampled=items.times_sampled
            ),
        )
    assert not os.listdir(tmp_path)


def test_the_reverb_and_tf_free_readers_agree_on_an_export(tmp_path: Path) -> None:
    pytest.importorskip("tf_agents")
    from replay_service.storage import export, importing

    stored, items = _stored_and_items(3)
    table = TableConfig(name="t", capacity=10, sequence_length=2)
    state_path, _ = export.write_export(tmp_path, "p_", table, stored, items)
    signature = specs.table_signature(stored, 2)
    by_signature = export.read_state(state_path, signature, 3)
    by_fields = export.read_state_fields(state_path, export.item_fields(stored, 2), 3)
    for a, b in zip(by_signature.data, by_fields.data, strict=True):
        np.testing.assert_array_equal(a, b)
    tf_stored = specs.to_tf_spec(stored)
    assert importing.read_export(table, tf_stored, tmp_path, "p_").num_items == 3


# ----------------------------------------------------------------------------------- lock


@pytest.mark.local
def test_a_second_store_on_a_locked_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = CheckpointStore(root)
    with first.locked():
        with pytest.raises(CheckpointError, match=f"{root}.*in use by another buffer"):
            CheckpointStore(root).lock()
        code = (
            "import sys\n"
            "from replay_service.storage.store import CheckpointStore\n"
            "from replay_service.errors import CheckpointError\n"
            f"try:\n    CheckpointStore({str(root)!r}).lock()\n"
            "except CheckpointError as e:\n    print(e); sys.exit(3)\n"
        )
        other = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert other.returncode == 3, other.stdout + other.stderr
        assert f"pid {os.getpid()}" in other.stdout and str(root) in other.stdout
    second = CheckpointStore(root)
    second.lock()  # released on exit from the block
    second.lock()  # taking it again is a no-op
    second.unlock()
    second.unlock()


@pytest.mark.local
@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links")
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("do not touch")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_FILE).symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        CheckpointStore(root).lock()
    assert target.read_text() == "do not touch"
    assert (root / LOCK_FILE).is_symlink()


# ------------------------------------------------------------------------ torch batches


class FakeSource:
    """A `TorchSampleSource` of 2-step windows made up in memory (no Reverb)."""

    table_name = "fake"
    sequence_length = 2
    signature = None

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def torch_samples(
        self, batch_size: int, *, num_workers: int | None, convert: Any
    ) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        import torch

        from replay_service.errors import BufferStateError

        convert = convert or (lambda t: t)
        for index in range(self.batches):
            data = Trajectory(
                step_type=torch.zeros([batch_size, 2], dtype=torch.int32),
                observation=torch.arange(batch_size * 2.0).reshape(batch_size, 2) + index,
                action=torch.ones([batch_size, 2, 1], dtype=torch.int64),
                policy_info=(),
                next_step_type=torch.tensor([[StepType.LAST, 0]] * batch_size),
                reward=torch.ones([batch_size, 2]),
                discount=torch.tensor([[0.0, 1.0]] * batch_size),
            )
            info = tuple(torch.full([batch_size], float(i)) for i in range(5))
            yield tree.map_structure(convert, data), info
        raise BufferStateError("no more items")


@pytest.mark.local
def test_torch_batches_come_from_any_sample_source() -> None:
    pytest.importorskip("torch")
    from replay_service.errors import BufferStateError
    from replay_service.sample.batches import TorchSampleInfo, TransitionBatch
    from replay_service.sample.torch_streams import TorchBatchStream, iterate_batches

    batches = iterate_batches(FakeSource(2), 3, transitions=True, with_info=True)
    batch, info = next(batches)
    assert isinstance(batch, TransitionBatch) and isinstance(info, TorchSampleInfo)
    assert batch.dones.tolist() == [True] * 3 and batch.truncated.tolist() == [False] * 3
    assert batch.hiddens is None and batch.next_states.tolist() == [1.0, 3.0, 5.0]
    assert info.times_sampled.tolist() == [4.0] * 3
    with TorchBatchStream(FakeSource(1), 3, prefetch=1) as stream:
        assert next(stream).observation.shape == (3, 2)
        with pytest.raises(BufferStateError, match="no more items"):
            next(stream)


@pytest.mark.local
def test_the_export_writer_gives_safetensors_bytes_for_every_dtype_and_split_arrays() -> None:
    import hashlib
    import io

    import safetensors.numpy

    from replay_service.storage.export_state import Concatenated, write_safetensors

    rng = np.random.default_rng(0)
    dtypes = ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32"]
    dtypes += ["float32", "float64", "int64", "uint64"]
    tensors: dict[str, Any] = {
        f"data/{i}": rng.integers(0, 100, (5, 2, 3)).astype(d) for i, d in enumerate(dtypes)
    }
    tensors["empty"] = np.zeros((0, 2), np.float32)
    metadata = {"format": "replay_service.storage.export/1"}
    expected = safetensors.numpy.save(tensors, metadata=metadata)
    # The same tensors, some handed over as views split in two (a ring buffer's two runs).
    split = dict(tensors)
    split["data/8"] = Concatenated((tensors["data/8"][:2], tensors["data/8"][2:]))
    for given in (tensors, split):
        out = io.BytesIO()
        digest = write_safetensors(out, given, metadata)
        assert out.getvalue() == expected
        assert digest == hashlib.sha256(expected).hexdigest()
    with pytest.raises(ConfigError, match="complex128"):
        write_safetensors(io.BytesIO(), {"x": np.zeros(2, np.complex128)}, metadata)


@pytest.mark.local
def test_a_written_file_that_does_not_read_back_as_written_is_refused(tmp_path) -> None:
    from replay_service.storage.export_state import _compare_read_back

    chunks = [b"header00", np.arange(3 << 20, dtype=np.uint8) % 251]
    path = tmp_path / "state.safetensors"
    path.write_bytes(b"".join(bytes(c) for c in chunks))
    _compare_read_back(str(path), chunks)  # reads back as written
    data = bytearray(path.read_bytes())
    data[(2 << 20) + 5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not read back as written near byte"):
        _compare_read_back(str(path), chunks)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match="does not read back"):
        _compare_read_back(str(path), chunks)
    path.write_bytes(b"".join(bytes(c) for c in chunks) + b"x")
    with pytest.raises(CheckpointError, match="longer than"):
        _compare_read_back(str(path), chunks)
