"""Files written by earlier releases load and import forever (tests/fixtures/formats/).

Each fixture was written by the commit it is named after (see its README.md and
make_fixtures.py): one episode of five steps, sequence_length 2, capacity 10, four items. A
checkpoint directory is loaded on the backend that wrote it, an export is imported on both
backends, and the items read back are compared value for value. A file whose format tag is
unknown or newer is refused with `UnknownFormatError` and left exactly as it was.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import FAST_TIMEOUTS, tree_digest
from replay_service import (
    CheckpointError,
    NoCheckpointError,
    ReplayBufferManager,
    UnknownFormatError,
)
from replay_service.storage import formats

pytestmark = pytest.mark.heavy

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "formats"
CAPACITY = 10
SEQUENCE_LENGTH = 2

SPEC = trajectory_lib.Trajectory(
    step_type=tf.TensorSpec([], tf.int32, "step_type"),
    observation=tf.TensorSpec([2], tf.float32, "observation"),
    action=tf.TensorSpec([], tf.int64, "action"),
    policy_info=(),
    next_step_type=tf.TensorSpec([], tf.int32, "step_type"),
    reward=tf.TensorSpec([], tf.float32, "reward"),
    discount=tf.TensorSpec([], tf.float32, "discount"),
)

# Step i of the episode (README.md): item k holds steps k and k + 1.
_STEPS = {
    "step_type": np.array([0, 1, 1, 1, 2], np.int32),
    "observation": np.array([[i + 0.25, -10.0 * i] for i in range(5)], np.float32),
    "action": np.array([100, 101, 102, 103, 104], np.int64),
    "next_step_type": np.array([1, 1, 1, 2, 0], np.int32),
    "reward": np.array([0.0, 0.5, 1.0, 1.5, 2.0], np.float32),
    "discount": np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32),
}
EXPECTED = {name: np.stack([steps[k : k + 2] for k in range(4)]) for name, steps in _STEPS.items()}

# Every fixture: (commit, name). Checkpoint directories end in "-checkpoint", exports in
# "-export"; the name starts with the backend that wrote it.
CHECKPOINTS = sorted(
    (era.name, d.name)
    for era in FIXTURES.iterdir()
    if era.is_dir()
    for d in era.iterdir()
    if d.name.endswith("-checkpoint")
)
EXPORTS = sorted(
    (era.name, d.name)
    for era in FIXTURES.iterdir()
    if era.is_dir()
    for d in era.iterdir()
    if d.name.endswith("-export")
)
EVERY_TAG_WRITTEN = {
    # 62df020 .. 5033aea^, and again since the tags became constants of their formats:
    "replay_service.checkpoint_dir/1": formats.STORE,
    "replay_service.export/1": formats.EXPORT,
    "replay_service.local_checkpoint/1": formats.LOCAL_CHECKPOINT,
    # 5033aea .. ae368cb: tags derived from module paths.
    "replay_service.storage.export/1": formats.EXPORT,
    "replay_service.backends.local.checkpoint/1": formats.LOCAL_CHECKPOINT,
}


def _backend(name: str) -> str:
    return "local" if name.startswith("local") else "reverb"


def _manager(checkpoint_dir: Path, backend: str) -> ReplayBufferManager:
    return ReplayBufferManager(
        SPEC,
        CAPACITY,
        str(checkpoint_dir),
        SEQUENCE_LENGTH,
        backend=backend,
        timeouts=FAST_TIMEOUTS,
    )


def _assert_exact_items(manager: ReplayBufferManager, readback: Path) -> None:
    """Exports `manager`'s buffer with today's code and compares every value."""
    assert manager.num_frames() == 4
    state_path, _ = manager.export(readback)
    tensors = load_file(state_path)
    for name, expected in EXPECTED.items():
        np.testing.assert_array_equal(tensors[f"data/{name}"], expected, err_msg=name)
        assert tensors[f"data/{name}"].dtype == expected.dtype, name
    np.testing.assert_array_equal(tensors["priorities"], np.ones(4))


def test_fixtures_cover_every_era_and_format():
    assert {era for era, _ in CHECKPOINTS} == {
        "62df020",
        "10168de",
        "2e3b524",
        "98cfc1b",
        "ae368cb",
    }
    assert ("2e3b524", "local-checkpoint") in CHECKPOINTS
    assert ("98cfc1b", "reverb-packed-checkpoint") in CHECKPOINTS
    assert ("10168de", "reverb-nested-export") in EXPORTS
    assert ("98cfc1b", "local-export") in EXPORTS
    written = set()
    for path in FIXTURES.rglob("*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        written.add(data["format"])
    assert written == set(EVERY_TAG_WRITTEN)


@pytest.mark.parametrize(("era", "name"), CHECKPOINTS)
def test_checkpoint_of_every_era_loads_with_its_items(era, name, tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / era / name, checkpoint_dir)
    manager = _manager(checkpoint_dir, _backend(name))
    try:
        manager.load_replay_buffer()
        assert manager.table_config.layout == ("packed" if "packed" in name else "nested")
        _assert_exact_items(manager, tmp_path / "readback")
    finally:
        manager.close()
    assert not (checkpoint_dir / "corrupt").exists()


@pytest.mark.parametrize("backend", ["reverb", "local"])
@pytest.mark.parametrize(("era", "name"), EXPORTS)
def test_export_of_every_era_imports_on_both_backends(era, name, backend, tmp_path):
    export_dir = tmp_path / "export"
    shutil.copytree(FIXTURES / era / name, export_dir)
    metadata = json.loads((export_dir / "buffer_metadata.json").read_text(encoding="utf-8"))
    manager = _manager(tmp_path / "ckpt", backend)
    try:
        if "sha256" in metadata:
            manager.import_buffer(export_dir)
        else:  # written before digests were recorded
            with pytest.warns(UserWarning, match="unverified"):
                manager.import_buffer(export_dir)
        _assert_exact_items(manager, tmp_path / "readback")
    finally:
        manager.close()


def _retag(path: Path, tag: str, key: tuple[str, ...] = ("format",)) -> None:
    """Rewrites the format tag of the JSON file `path` (at `key`) and, as a release that wrote
    that tag would, the digest recorded of it in its checkpoint's metadata."""
    data = json.loads(path.read_text(encoding="utf-8"))
    node = data
    for part in key[:-1]:
        node = node[part]
    node[key[-1]] = tag
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    info_path = path.parent / "replay_service_checkpoint.json"
    if info_path.exists() and info_path != path:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        if path.name in info.get("files", {}):
            content = path.read_bytes()
            info["files"][path.name] = {
                "size": len(content),
                "sha256": hashlib.sha256(content).hexdigest(),
            }
            info_path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


# (fixture, file under the checkpoint directory, key of the tag in it, format)
_TAGGED_FILES = [
    ("reverb-nested-checkpoint", "replay_service.json", ("format",), formats.STORE),
    ("reverb-nested-checkpoint", "CKPT/replay_service_checkpoint.json", ("format",), formats.STORE),
    (
        "reverb-nested-checkpoint",
        "CKPT/replay_service_checkpoint.json",
        ("store", "format"),
        formats.STORE,
    ),
    ("local-checkpoint", "CKPT/local_checkpoint.json", ("format",), formats.LOCAL_CHECKPOINT),
    ("local-checkpoint", "CKPT/table0.metadata.json", ("format",), formats.EXPORT),
    (
        "local-checkpoint",
        "CKPT/replay_service_checkpoint.json",
        ("store", "format"),
        formats.STORE,
    ),
]


@pytest.mark.parametrize("future", [True, False], ids=["newer-version", "unknown-format"])
@pytest.mark.parametrize(("name", "file", "key", "file_format"), _TAGGED_FILES)
def test_checkpoint_of_a_newer_format_is_refused_and_left_in_place(
    name, file, key, file_format, future, tmp_path
):
    checkpoint_dir = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "ae368cb" / name, checkpoint_dir)
    (ckpt,) = (checkpoint_dir / "checkpoints").iterdir()
    tag = f"{file_format.name}/2" if future else "replay_service.some_other_format/1"
    _retag(checkpoint_dir / file.replace("CKPT", f"checkpoints/{ckpt.name}"), tag, key)
    before = tree_digest(checkpoint_dir)
    manager = _manager(checkpoint_dir, _backend(name))
    try:
        with pytest.raises(UnknownFormatError, match="Upgrade replay_service") as raised:
            manager.load_replay_buffer()
    finally:
        manager.close()
    message = str(raised.value)
    assert repr(tag) in message and repr(file_format.tag) in message
    assert ("version 2, written by a newer replay_service" in message) == future
    assert ("does not know" in message) == (not future)
    assert isinstance(raised.value, CheckpointError)
    assert not isinstance(raised.value, NoCheckpointError)
    after = tree_digest(checkpoint_dir)
    assert not (checkpoint_dir / "corrupt").exists()
    # Only what a load makes beside the checkpoints (its lock, the staging roots) is new.
    assert {k: v for k, v in after.items() if k in before} == before
    assert not {k for k in after if k not in before} - {".lock", ".reverb", ".restore"}


@pytest.mark.parametrize("future", [True, False], ids=["newer-version", "unknown-format"])
@pytest.mark.parametrize("backend", ["reverb", "local"])
def test_export_of_a_newer_format_is_refused_on_both_backends(backend, future, tmp_path):
    export_dir = tmp_path / "export"
    shutil.copytree(FIXTURES / "ae368cb" / "reverb-nested-export", export_dir)
    tag = "replay_service.export/2" if future else "something.else/1"
    _retag(export_dir / "buffer_metadata.json", tag)
    before = tree_digest(export_dir)
    manager = _manager(tmp_path / "ckpt", backend)
    try:
        with pytest.raises(UnknownFormatError, match="Upgrade replay_service") as raised:
            manager.import_buffer(export_dir)
    finally:
        manager.close()
    assert repr(tag) in str(raised.value) and "buffer_metadata.json" in str(raised.value)
    assert tree_digest(export_dir) == before
    assert not (tmp_path / "ckpt").exists()


def _retag_state_header(state: Path, metadata: Path, tag: str) -> None:
    """Rewrites the format tag in a safetensors file's header and, as a release that wrote that
    tag would, the digest its export metadata records of it."""
    raw = state.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"]["format"] = tag
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    state.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])
    info = json.loads(metadata.read_text(encoding="utf-8"))
    info["sha256"]["state.safetensors"] = hashlib.sha256(state.read_bytes()).hexdigest()
    metadata.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


@pytest.mark.parametrize("backend", ["reverb", "local"])
def test_an_export_whose_state_header_is_of_a_newer_format_is_refused(backend, tmp_path):
    """The metadata file says format 1, the state file's own header says 2: refused too."""
    export_dir = tmp_path / "export"
    shutil.copytree(FIXTURES / "ae368cb" / "reverb-nested-export", export_dir)
    state = export_dir / "buffer_state.safetensors"
    _retag_state_header(state, export_dir / "buffer_metadata.json", "replay_service.export/2")
    before = tree_digest(export_dir)
    manager = _manager(tmp_path / "ckpt", backend)
    try:
        with pytest.raises(UnknownFormatError, match="Upgrade replay_service") as raised:
            manager.import_buffer(export_dir)
    finally:
        manager.close()
    assert "buffer_state.safetensors" in str(raised.value)
    assert tree_digest(export_dir) == before


@pytest.mark.parametrize("name", ["local-checkpoint", "reverb-nested-checkpoint"])
def test_a_damaged_checkpoint_is_still_moved_aside(name, tmp_path):
    """A truncated metadata file is damage, as before: the checkpoint goes to corrupt/."""
    checkpoint_dir = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "ae368cb" / name, checkpoint_dir)
    (ckpt,) = (checkpoint_dir / "checkpoints").iterdir()
    damaged = ckpt / ("local_checkpoint.json" if name.startswith("local") else "items.tfrecord")
    damaged.write_bytes(damaged.read_bytes()[:20])
    manager = _manager(checkpoint_dir, _backend(name))
    try:
        with pytest.raises(NoCheckpointError, match="moved aside as damaged"):
            manager.load_replay_buffer()
    finally:
        manager.close()
    assert not ckpt.exists()
    assert [p.name.startswith(ckpt.name) for p in (checkpoint_dir / "corrupt").iterdir()] == [True]


def test_every_format_tag_is_a_constant_and_every_tag_written_is_read():
    for file_format in formats.FORMATS:
        assert file_format.tag == f"{file_format.name}/{file_format.version}"
        for tag in file_format.read_tags:
            assert isinstance(tag, str) and "/" in tag
        # The tag written is no module path: moving code never changes what files say.
        module = file_format.name
        try:
            spec: Any = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        assert spec is None, f"{file_format.tag!r} names the module {module}"
    written = {f.tag for f in formats.FORMATS}
    assert written == {
        "replay_service.checkpoint_dir/1",
        "replay_service.local_checkpoint/1",
        "replay_service.export/1",
    }
    for tag, file_format in EVERY_TAG_WRITTEN.items():
        file_format.check(tag, "test")
        assert [f for f in formats.FORMATS if f.reads(tag)] == [file_format]


def test_a_tag_that_is_missing_is_damage_and_one_unknown_is_refused():
    with pytest.raises(CheckpointError, match="no format tag") as missing:
        formats.EXPORT.check(None, "f.json")
    assert not isinstance(missing.value, UnknownFormatError)
    with pytest.raises(UnknownFormatError, match=r"version 12, written by a newer"):
        formats.LOCAL_CHECKPOINT.check("replay_service.backends.local.checkpoint/12", "f.json")
    with pytest.raises(UnknownFormatError, match="does not know"):
        formats.STORE.check("replay_service.export/1", "f.json")


def test_files_written_now_carry_the_original_tags(tmp_path):
    manager = _manager(tmp_path / "ckpt", "local")
    try:
        manager.create_replay_buffer()
        manager.checkpoint()
        manager.export(tmp_path / "export")
    finally:
        manager.close()
    (ckpt,) = (tmp_path / "ckpt" / "checkpoints").iterdir()
    tags = {
        p.name: json.loads(p.read_text(encoding="utf-8"))["format"]
        for p in [
            tmp_path / "ckpt" / "replay_service.json",
            ckpt / "replay_service_checkpoint.json",
            ckpt / "local_checkpoint.json",
            ckpt / "table0.metadata.json",
            tmp_path / "export" / "buffer_metadata.json",
        ]
    }
    assert tags == {
        "replay_service.json": "replay_service.checkpoint_dir/1",
        "replay_service_checkpoint.json": "replay_service.checkpoint_dir/1",
        "local_checkpoint.json": "replay_service.local_checkpoint/1",
        "table0.metadata.json": "replay_service.export/1",
        "buffer_metadata.json": "replay_service.export/1",
    }
    with open(tmp_path / "export" / "buffer_state.safetensors", "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
    assert header["__metadata__"] == {"format": "replay_service.export/1"}
