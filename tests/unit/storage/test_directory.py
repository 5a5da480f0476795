"""`storage.directory`: reading a checkpoint directory's layout without changing anything.

`tests/unit/storage/test_store.py` drives the directory through the store; here its own reads,
its checks of links and roots, and its messages.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from replay_service.errors import (
    BackendMismatchError,
    CheckpointError,
    ConfigError,
    NoCheckpointError,
    UnknownFormatError,
)
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CORRUPT_DIR,
    LOCK_FILE,
    OWN_DIRS,
    REVERB_DIR,
    STORE_FILE,
    CheckpointDirectory,
    check_backend_of,
    check_root,
    foreign_message,
    parse_sequence,
)
from replay_service.storage.files import DONE_FILE
from replay_service.storage.metadata import FORMAT, Checkpoint, StoreMetadata
from storage_fakes import SuffixFormat

pytestmark = pytest.mark.local

META = StoreMetadata("t", 2, 10, [{"path": "x", "dtype": "float32", "shape": []}], layout="packed")


FORMATS = (SuffixFormat("local", ".safetensors"), SuffixFormat("reverb", ".tfrecord", settle_s=5.0))


def store(root: Path) -> CheckpointDirectory:
    root.mkdir(exist_ok=True)
    (root / STORE_FILE).write_text(json.dumps(META.to_json()))
    return CheckpointDirectory(root, FORMATS)


def checkpoint(root: Path, sequence: int, info: dict | None = None, done: bool = True) -> Path:
    path = root / CHECKPOINTS_DIR / f"ckpt-{sequence:08d}"
    path.mkdir(parents=True)
    if done:
        (path / DONE_FILE).write_text("")
    if info is not None:
        (path / CHECKPOINT_META_FILE).write_text(json.dumps({"format": FORMAT, **info}))
    return path


@pytest.mark.parametrize(
    ("name", "sequence"),
    [("ckpt-00000001", 1), ("ckpt-12", 12), ("ckpt-", None), ("ckpt-²", None), ("x-1", None)],
)
def test_parse_sequence_takes_ascii_digits_after_the_prefix(name, sequence):
    assert parse_sequence(name) == sequence


def test_the_paths_of_the_layout(tmp_path):
    directory = CheckpointDirectory(tmp_path / "a" / ".." / "d")
    assert directory.root == str(tmp_path / "d")
    assert directory.store_file == str(tmp_path / "d" / STORE_FILE)
    assert directory.reverb_root == str(tmp_path / "d" / REVERB_DIR)
    assert directory.checkpoints_dir == str(tmp_path / "d" / CHECKPOINTS_DIR)
    assert directory.formats  # the registered ones
    assert CheckpointDirectory(tmp_path, FORMATS).formats == FORMATS


def test_entries_are_checkpoint_directories_only_oldest_first(tmp_path):
    directory = store(tmp_path)
    checkpoint(tmp_path, 10, done=False)
    checkpoint(tmp_path, 2)
    (tmp_path / CHECKPOINTS_DIR / "ckpt-00000003").write_text("a file")
    (tmp_path / CHECKPOINTS_DIR / "notes").mkdir()
    (tmp_path / CHECKPOINTS_DIR / "ckpt-00000004").symlink_to(tmp_path / CHECKPOINTS_DIR / "notes")
    assert [s for s, _ in directory.entries()] == [2, 10]


def test_checkpoints_skip_what_does_not_read_and_latest_is_the_newest(tmp_path):
    directory = store(tmp_path)
    assert directory.latest() is None
    checkpoint(tmp_path, 1, {"num_items": 3})
    checkpoint(tmp_path, 2, None)  # no metadata file
    checkpoint(tmp_path, 3, {"num_items": 5}, done=False)
    assert [c.sequence for c in directory.checkpoints()] == [1]
    latest = directory.latest()
    assert latest is not None and latest.num_items == 3 and latest.formats == FORMATS


def test_read_checkpoint_names_what_is_missing_or_malformed(tmp_path):
    directory = store(tmp_path)
    path = checkpoint(tmp_path, 1, done=False)
    with pytest.raises(CheckpointError, match=r"has no DONE file$"):
        directory.read_checkpoint(1, str(path))
    (path / DONE_FILE).write_text("")
    with pytest.raises(CheckpointError, match=f"cannot read .*{CHECKPOINT_META_FILE}"):
        directory.read_checkpoint(1, str(path))
    (path / CHECKPOINT_META_FILE).write_text("[1]")
    with pytest.raises(CheckpointError, match="is malformed: list"):
        directory.read_checkpoint(1, str(path))
    newer = FORMAT.rsplit("/", 1)[0] + "/99"
    (path / CHECKPOINT_META_FILE).write_text(json.dumps({"format": newer}))
    with pytest.raises(UnknownFormatError):
        directory.read_checkpoint(1, str(path))


def test_read_metadata_tells_nothing_empty_foreign_and_a_store_apart(tmp_path):
    with pytest.raises(NoCheckpointError, match="does not exist"):
        CheckpointDirectory(tmp_path / "missing").read_metadata()
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        CheckpointDirectory(tmp_path / "file").read_metadata()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK_FILE).write_text("")
    with pytest.raises(NoCheckpointError, match="is empty: there is nothing to load"):
        CheckpointDirectory(empty).read_metadata()
    (empty / "data.csv").write_text("")
    with pytest.raises(CheckpointError, match=r"is not a replay_service checkpoint directory"):
        CheckpointDirectory(empty).read_metadata()
    assert store(tmp_path / "d").read_metadata() == META
    (tmp_path / "d" / STORE_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="cannot read .*replay_service.json"):
        CheckpointDirectory(tmp_path / "d").read_metadata()


def test_stored_layout_is_none_without_a_readable_store(tmp_path):
    assert CheckpointDirectory(tmp_path).stored_layout() is None
    directory = store(tmp_path)
    assert directory.stored_layout() == "packed"
    (tmp_path / STORE_FILE).write_text("not json")
    assert directory.stored_layout() is None


def test_has_checkpoints_counts_damaged_staged_and_quarantined_ones(tmp_path):
    directory = store(tmp_path)
    assert not directory.has_checkpoints()
    (tmp_path / CORRUPT_DIR / "ckpt-00000001").mkdir(parents=True)
    (tmp_path / CORRUPT_DIR / "other").mkdir()
    assert directory.quarantined() == [str(tmp_path / CORRUPT_DIR / "ckpt-00000001")]
    assert directory.has_checkpoints()
    checkpoint(tmp_path, 2, done=False)  # a newer one, even damaged: the quarantine is old
    assert directory.quarantined() == []
    assert directory.has_checkpoints()
    assert not CheckpointDirectory(tmp_path / CHECKPOINTS_DIR, FORMATS).has_checkpoints()


def test_staged_lists_done_checkpoints_and_settled_only_waits_the_longest_settle(tmp_path):
    directory = store(tmp_path)
    for name, done in (("a", True), ("b", False)):
        (tmp_path / REVERB_DIR / name).mkdir(parents=True)
        if done:
            (tmp_path / REVERB_DIR / name / DONE_FILE).write_text("")
    assert directory.staged() == [str(tmp_path / REVERB_DIR / "a")]
    assert directory.staged(settled_only=True) == []  # reverb's 5 s have not passed
    old = time.time() - 10
    os.utime(tmp_path / REVERB_DIR / "a" / DONE_FILE, (old, old))
    assert directory.staged(settled_only=True) == [str(tmp_path / REVERB_DIR / "a")]


def test_check_backend_of_refuses_the_other_backends_checkpoint(tmp_path):
    written = Checkpoint(str(tmp_path), 1, {"backend": "reverb"}, FORMATS)
    check_backend_of(written, "reverb")
    check_backend_of(Checkpoint(str(tmp_path), 1, {}, FORMATS), "local")  # unknown: verified later
    with pytest.raises(BackendMismatchError) as raised:
        check_backend_of(written, "local")
    message = str(raised.value)
    assert message.startswith(
        f"checkpoint {str(tmp_path)!r} was written by the 'reverb' backend, but this buffer uses "
        "backend='local', which cannot read it; nothing was moved or changed."
    )
    assert "import_buffer() the export into a new buffer with backend='local'" in message
    directory = store(tmp_path / "d")
    checkpoint(tmp_path / "d", 1, {"backend": "reverb"})
    with pytest.raises(BackendMismatchError):
        directory.check_backend("local")
    directory.check_backend("reverb")


def test_check_root_takes_a_missing_path_and_names_a_loop_or_a_nul(tmp_path):
    check_root(str(tmp_path / "not" / "yet"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointError, match=r"cannot be resolved: a symbolic link on that path"):
        check_root(str(tmp_path / "loop" / "ckpt"))
    with pytest.raises(ConfigError, match="checkpoint_dir .* holds a NUL character"):
        check_root(str(tmp_path) + "\0")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"^cannot use checkpoint_dir '.*file/ckpt': "):
        check_root(str(tmp_path / "file" / "ckpt"))


@pytest.mark.parametrize("name", OWN_DIRS)
def test_each_own_directory_that_is_a_link_is_refused_naming_its_target(tmp_path, name):
    directory = store(tmp_path / "d")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "d" / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as raised:
        directory.check_own_dirs()
    assert str(raised.value).startswith(
        f"{str(tmp_path / 'd' / name)!r} is a symbolic link (to {str(tmp_path / 'elsewhere')!r})"
    )


def test_a_checkpoint_that_is_a_link_is_refused_and_other_links_left(tmp_path):
    directory = store(tmp_path / "d")
    real = checkpoint(tmp_path / "d", 1, {})
    (tmp_path / "d" / CHECKPOINTS_DIR / "notes").symlink_to(real)
    directory.check_own_dirs()
    (tmp_path / "d" / CHECKPOINTS_DIR / "ckpt-00000002").symlink_to(real)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*ckpt-00000002' is a symbolic link"):
        directory.check_checkpoint_links()


def test_foreign_message_lists_five_entries_and_recognises_a_bare_reverb_root(tmp_path):
    names = [f"f{i}" for i in range(7)]
    message = foreign_message(str(tmp_path), names, STORE_FILE)
    assert f"(no {STORE_FILE}); it contains: f0, f1, f2, f3, f4, ...." in message
    assert "bare Reverb checkpoint root" not in message
    (tmp_path / "2024-01-01").mkdir()
    (tmp_path / "2024-01-01" / DONE_FILE).write_text("")
    message = foreign_message(str(tmp_path), ["2024-01-01"], STORE_FILE)
    assert "It is a bare Reverb checkpoint root" in message
    assert f"--buffer-name {tmp_path.name} --output-dir {tmp_path.parent}" in message
    assert message.endswith("files that are not replay_service's are never deleted.")


def test_a_checkpoint_dir_that_links_to_nothing_is_refused_naming_the_link(tmp_path):
    link = tmp_path / "replay"
    link.symlink_to(tmp_path / "mount" / "replay")
    with pytest.raises(CheckpointError, match=r"is a symbolic link to .*mount/replay.*does not"):
        check_root(str(link))
    check_root(str(tmp_path / "new"))  # a path that does not exist yet is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay"]
