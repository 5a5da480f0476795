"""Data safety of the checkpoint directory on both backends: links, the other backend's
checkpoints, a refused second process, unusable paths and file modes (issue #25)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import tree_digest
from replay_service import (
    BackendMismatchError,
    CheckpointError,
    ConfigError,
    ReplayBufferManager,
    TableConfig,
    copy_buffer,
)
from replay_service.errors import NotRegularFileError

BACKENDS = ("reverb", "local")
CHECKPOINT_META = "replay_service_checkpoint.json"
CHECKPOINTS = "checkpoints"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def write_items(manager: ReplayBufferManager, episode: int, length: int) -> None:
    """One terminated episode of `length` transitions; state i is `[episode, i, 0, 0]`."""
    writer = manager.transition_writer()
    for i in range(length):
        state = np.array([episode, i, 0, 0], np.float32)
        following = np.array([episode, i + 1, 0, 0], np.float32)
        writer.add(state, i % 2, float(i), following, i == length - 1)
    writer.flush()


def filled(make_manager: Any, backend: str, root: Path, checkpoints: int = 2) -> int:
    """A closed buffer in `root` with `checkpoints` checkpoints; returns its item count."""
    manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    manager.create_replay_buffer()
    for episode in range(checkpoints):
        write_items(manager, episode, 3)
        manager.checkpoint()
    frames = manager.num_frames()
    manager.close()
    return frames


def digest_except(root: Path, skipped: Path) -> dict[str, Any]:
    """A `tree_digest` of each entry of `root` but `skipped` (a link that loops) and the lock."""
    return {
        entry.name: tree_digest(entry) if entry.is_dir() else entry.read_bytes()
        for entry in root.iterdir()
        if entry != skipped and entry.name != ".lock"
    }


def without_lock(digest: dict[str, str]) -> dict[str, str]:
    """A `tree_digest` less the lock file (each holder writes its pid there)."""
    return {path: value for path, value in digest.items() if path != ".lock"}


# ------------------------------------------------------------- links inside checkpoint_dir


@pytest.mark.parametrize("name", [".reverb", ".restore", "corrupt", "checkpoints"])
def test_a_linked_own_directory_is_refused_and_nothing_outside_is_touched(
    make_manager, backend, tmp_path, name
):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, backend, root)
    outside = tmp_path / "outside"
    (outside / "ckpt-00000009").mkdir(parents=True)
    (outside / "ckpt-00000009" / "DONE").write_text("")
    (outside / "notes.txt").write_text("not replay_service's")
    link = root / name
    if name == "checkpoints":  # the checkpoints move out of the way, the link replaces them
        os.rename(link, tmp_path / "moved")
    elif link.exists():
        shutil.rmtree(link)
    os.symlink(outside, link)
    outside_before, root_before = tree_digest(outside), without_lock(tree_digest(root))

    manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    with pytest.raises(CheckpointError, match=rf"{name}'? is a symbolic link .*outside"):
        manager.load_replay_buffer()
    manager.close()
    assert tree_digest(outside) == outside_before
    assert without_lock(tree_digest(root)) == root_before
    assert os.readlink(link) == str(outside)

    os.remove(link)
    if name == "checkpoints":
        os.rename(tmp_path / "moved", link)
    loaded = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == frames
    assert not (root / "corrupt").exists()


@pytest.mark.parametrize("name", [".reverb", "checkpoints"])
def test_a_looping_own_directory_is_refused_by_a_new_buffer(make_manager, backend, tmp_path, name):
    root = tmp_path / "ckpt"
    filled(make_manager, backend, root)
    link = root / name
    os.rename(link, tmp_path / "moved")
    os.symlink(link, link)  # points to itself
    before = digest_except(root, link)
    assert before[CHECKPOINTS if name != CHECKPOINTS else "replay_service.json"]
    for overwrite in (True, False):
        manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
        with pytest.raises(CheckpointError, match=rf"'{link}' is a symbolic link"):
            manager.create_replay_buffer(overwrite=overwrite)
        manager.close()
    assert digest_except(root, link) == before
    assert os.readlink(link) == str(link)


def test_a_checkpoint_that_is_a_link_is_refused_not_skipped(make_manager, backend, tmp_path):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, backend, root, checkpoints=3)
    newest = root / CHECKPOINTS / "ckpt-00000003"
    outside = tmp_path / "outside"
    os.rename(newest, outside)
    os.symlink(outside, newest)
    outside_before, root_before = tree_digest(outside), without_lock(tree_digest(root))
    for start in ("load", "create"):
        manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
        with pytest.raises(CheckpointError, match=rf"checkpoint '{newest}' is a symbolic link"):
            if start == "load":  # loaded the older ckpt-00000002 without a word before
                manager.load_replay_buffer()
            else:
                manager.create_replay_buffer(overwrite=True)
        manager.close()
    # A copy reads the newest checkpoint too (it copied the older ckpt-00000002 before).
    with pytest.raises(CheckpointError, match=rf"checkpoint '{newest}' is a symbolic link"):
        copy_buffer(root, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    assert tree_digest(outside) == outside_before
    assert without_lock(tree_digest(root)) == root_before
    assert not (root / "corrupt").exists()

    os.remove(newest)
    os.rename(outside, newest)
    loaded = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == frames


# ---------------------------------------------------------- named pipes inside checkpoint_dir

# Long enough for a Reverb load on a busy machine; a load that opens a named pipe nobody
# writes never returns, so the call runs in a thread and a regression fails here instead.
PIPE_TIMEOUT_S = 90


def finishes(call: Any, pipes: list[Path]) -> Any:
    """Runs `call()` in a thread; returns what it returned or raised, or fails the test if it
    is still running after `PIPE_TIMEOUT_S` (then `pipes` get a writer, so it ends)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # handed to the test
            outcome["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PIPE_TIMEOUT_S)
    if thread.is_alive():
        for pipe in pipes:  # a reader blocked in open() returns once a writer opens the pipe
            with contextlib.suppress(OSError):
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(PIPE_TIMEOUT_S)
        pytest.fail(f"the call did not return within {PIPE_TIMEOUT_S} s: it opened {pipes}")
    return outcome["value"]


def is_pipe(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def load_from_spaces(make_from_spaces: Any, backend: str) -> Any:
    """A call that loads the `from_spaces` buffer in tmp_path/"ckpt" with `backend` and
    returns its frame count (for `finishes`)."""

    def load() -> int:
        manager = make_from_spaces(backend, capacity=100)
        try:
            manager.load_replay_buffer()
            return manager.num_frames()
        finally:
            manager.close()

    return load


def filled_from_spaces(make_from_spaces: Any, backend: str) -> int:
    """`filled` for a `from_spaces` buffer (CartPole shapes) in tmp_path/"ckpt"."""
    manager = make_from_spaces(backend, capacity=100)
    manager.create_replay_buffer()
    for episode in range(2):
        write_items(manager, episode, 3)
        manager.checkpoint()
    frames = manager.num_frames()
    manager.close()
    return frames


@pytest.mark.heavy
def test_named_pipes_beside_the_checkpoint_files_are_left_alone(
    make_from_spaces, backend, tmp_path
):
    root = tmp_path / "ckpt"
    frames = filled_from_spaces(make_from_spaces, backend)
    newest = max((root / CHECKPOINTS).iterdir())
    pipes = [root / "pipe", newest / "pipe"]
    for pipe in pipes:
        os.mkfifo(pipe)
    for choice in ("auto", backend):  # "auto" reads the newest checkpoint to pick a backend
        assert finishes(load_from_spaces(make_from_spaces, choice), pipes) == frames
    assert all(is_pipe(pipe) for pipe in pipes)
    assert not (root / "corrupt").exists()


def own_files(backend: str) -> list[str]:
    """Files of a checkpoint directory (relative; `NEWEST` is the newest checkpoint) that a
    load opens."""
    data = "items.tfrecord" if backend == "reverb" else "table0.state.safetensors"
    return [
        "replay_service.json",
        ".lock",
        f"NEWEST/{CHECKPOINT_META}",
        "NEWEST/DONE",
        f"NEWEST/{data}",
    ]


@pytest.mark.heavy
def test_a_named_pipe_in_place_of_a_checkpoint_file_is_refused_never_opened_or_moved(
    make_from_spaces, backend, tmp_path
):
    root = tmp_path / "ckpt"
    frames = filled_from_spaces(make_from_spaces, backend)
    newest = max((root / CHECKPOINTS).iterdir())
    for name in own_files(backend):
        path = Path(str(root / name).replace(str(root / "NEWEST"), str(newest)))
        aside = path.with_name(path.name + ".aside")
        if path.exists():
            os.rename(path, aside)
        os.mkfifo(path)
        before = without_lock(tree_digest(root))
        # "auto" first: it reads the newest checkpoint to find the backend that wrote it.
        for choice in ("auto", backend):
            error = finishes(load_from_spaces(make_from_spaces, choice), [path])
            assert isinstance(error, NotRegularFileError), (name, error)
            assert re.search(rf"'{re.escape(str(path))}' is a named pipe \(FIFO\)", str(error))
            assert is_pipe(path), name
            assert without_lock(tree_digest(root)) == before, name
            assert not (root / "corrupt").exists(), name
        os.remove(path)
        if aside.exists():
            os.rename(aside, path)
    assert finishes(load_from_spaces(make_from_spaces, "auto"), []) == frames


@pytest.mark.heavy
def test_import_refuses_a_named_pipe_in_place_of_an_export_file(make_manager, backend, tmp_path):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, backend, root)
    source = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    source.load_replay_buffer()
    state_path, metadata_path = (Path(p) for p in source.export(tmp_path / "export"))
    source.close()
    beside = tmp_path / "export" / "pipe"
    os.mkfifo(beside)
    for path in (metadata_path, state_path):
        aside = path.with_name(path.name + ".aside")
        os.rename(path, aside)
        os.mkfifo(path)
        target = make_manager(backend=backend, checkpoint_dir=str(tmp_path / "target"))
        importing = functools.partial(target.import_buffer, tmp_path / "export")
        error = finishes(importing, [path, beside])
        assert isinstance(error, NotRegularFileError), error
        assert f"'{path}' is a named pipe (FIFO)" in str(error)
        assert is_pipe(path)
        target.close()
        os.remove(path)
        os.rename(aside, path)
    target = make_manager(backend=backend, checkpoint_dir=str(tmp_path / "target"))
    finishes(functools.partial(target.import_buffer, tmp_path / "export"), [beside])
    assert target.num_frames() == frames
    assert is_pipe(beside)


# ------------------------------------------------- the local backend's memory-mapped storage


def memmap_manager(make_manager: Any, root: Path, **kwargs: Any) -> ReplayBufferManager:
    return make_manager(
        backend="local", storage="memmap", checkpoint_dir=str(root), capacity=100, **kwargs
    )


@pytest.mark.parametrize("name", [".", ".."])
def test_a_table_name_that_is_a_directory_is_refused_and_the_checkpoints_stay(
    make_manager, backend, tmp_path, name
):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, backend, root)
    before = without_lock(tree_digest(root))
    options = {"backend": backend, "checkpoint_dir": str(root), "capacity": 100}
    if backend == "local":
        options["storage"] = "memmap"
    for start in ("load", "create"):
        with pytest.raises(ConfigError, match=rf"table name must not be '{re.escape(name)}'"):
            manager = make_manager(table_name=name, **options)
            if start == "load":
                manager.load_replay_buffer()
            else:
                manager.create_replay_buffer(overwrite=True)
    with pytest.raises(ConfigError, match=rf"table name must not be '{re.escape(name)}'"):
        make_manager(extra_tables=[TableConfig(name=name, capacity=100)], **options)
    assert without_lock(tree_digest(root)) == before
    loaded = make_manager(**options)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == frames


@pytest.mark.parametrize("kind", ["outside", "loop"])
@pytest.mark.parametrize("start", ["create", "load"])
def test_a_linked_memmap_table_directory_is_refused_and_nothing_is_touched(
    make_manager, tmp_path, kind, start
):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, "local", root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "field0.memmap").write_text("not replay_service's")
    (outside / "notes.txt").write_text("not replay_service's")
    table = make_manager(backend="local", checkpoint_dir=str(root)).table_name
    link = root / ".memmap" / table
    link.parent.mkdir()
    os.symlink(outside if kind == "outside" else link, link)
    outside_before, root_before = tree_digest(outside), digest_except(root, root / ".memmap")

    manager = memmap_manager(make_manager, root)
    with pytest.raises(CheckpointError, match=rf"'{link}' is a symbolic link"):
        if start == "load":
            manager.load_replay_buffer()
        else:
            manager.create_replay_buffer(overwrite=True)
    manager.close()
    assert tree_digest(outside) == outside_before
    assert digest_except(root, root / ".memmap") == root_before  # no checkpoint moved
    assert not (root / "corrupt").exists()
    assert os.path.islink(link)

    os.remove(link)
    loaded = memmap_manager(make_manager, root)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == frames


def test_a_memmap_table_directory_keeps_what_it_did_not_create(make_manager, tmp_path):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, "local", root)
    table = make_manager(backend="local", checkpoint_dir=str(root)).table_name
    scratch = root / ".memmap" / table
    scratch.mkdir(parents=True)
    (scratch / "field0.memmap").write_bytes(b"an earlier buffer's file")
    (scratch / "notes.txt").write_text("not replay_service's")
    before = without_lock(tree_digest(root))
    manager = memmap_manager(make_manager, root)
    with pytest.raises(CheckpointError, match=rf"'{scratch}' holds entries .*'notes.txt'"):
        manager.load_replay_buffer()
    manager.close()
    assert without_lock(tree_digest(root)) == before

    os.remove(scratch / "notes.txt")  # an earlier buffer's files alone are replaced
    loaded = memmap_manager(make_manager, root)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == frames
    assert (scratch / "field0.memmap").stat().st_size > len(b"an earlier buffer's file")


def test_memmap_directories_get_explicit_modes_under_umask_000(make_manager, tmp_path):
    root = tmp_path / "ckpt"
    old = os.umask(0)
    try:
        manager = memmap_manager(make_manager, root)
        manager.create_replay_buffer()
        write_items(manager, 0, 3)
    finally:
        os.umask(old)
    scratch = root / ".memmap" / manager.table_name
    modes = {
        os.path.relpath(path, root): stat.S_IMODE(os.lstat(path).st_mode)
        for path in [root / ".memmap", scratch, *scratch.iterdir()]
    }
    assert len(modes) > 2
    assert {p: oct(m) for p, m in modes.items() if m & 0o027} == {}
    assert modes[".memmap"] == modes[os.path.relpath(scratch, root)] == 0o750


# ------------------------------------------------------------ the other backend's checkpoints


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "inferred"])
@pytest.mark.parametrize("writer,reader", [("reverb", "local"), ("local", "reverb")])
def test_a_checkpoint_of_the_other_backend_is_refused_and_moves_nothing(
    make_manager, tmp_path, writer, reader, recorded
):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, writer, root)
    metas = sorted((root / "checkpoints").glob(f"ckpt-*/{CHECKPOINT_META}"))
    assert len(metas) == 2
    for meta in metas:
        info = json.loads(meta.read_text())
        assert info["backend"] == writer
        if not recorded:  # as written before the field existed: recognised by its files
            del info["backend"]
            meta.write_text(json.dumps(info))
    before = without_lock(tree_digest(root))

    other = make_manager(backend=reader, checkpoint_dir=str(root), capacity=100)
    with pytest.raises(BackendMismatchError) as raised:
        other.load_replay_buffer()
    other.close()
    message = str(raised.value)
    assert f"written by the {writer!r} backend" in message
    assert f"backend={reader!r}" in message and "export()" in message
    assert "import_buffer()" in message and "nothing was moved" in message
    assert without_lock(tree_digest(root)) == before
    assert not (root / "corrupt").exists()

    right = make_manager(backend=writer, checkpoint_dir=str(root), capacity=100)
    right.load_replay_buffer()
    assert right.num_frames() == frames


# ------------------------------------------------------------------- a refused second process


@pytest.mark.heavy
def test_a_refused_second_memmap_buffer_keeps_the_first_ones_files(make_manager, tmp_path):
    root = tmp_path / "ckpt"
    options = {"backend": "local", "storage": "memmap", "checkpoint_dir": str(root)}
    first = make_manager(capacity=100, **options)
    first.create_replay_buffer()
    write_items(first, 0, 5)
    scratch = sorted(p for p in (root / ".memmap").rglob("*") if p.is_file())
    assert scratch
    before = tree_digest(root / ".memmap")

    for start in ("load", "create"):
        second = make_manager(capacity=100, **options)
        with pytest.raises(CheckpointError, match="in use"):
            if start == "load":
                second.load_replay_buffer()
            else:
                second.create_replay_buffer(overwrite=True)
        second.close()
    assert tree_digest(root / ".memmap") == before

    assert first.num_frames() == 5
    first.checkpoint()
    first.close()  # its own scratch files go with it
    assert not (root / ".memmap").exists()
    again = make_manager(capacity=100, **options)
    again.load_replay_buffer()
    assert again.num_frames() == 5


# -------------------------------------------------------------------------- unusable paths


def test_a_copy_target_that_is_a_link_is_refused_naming_it(make_manager, backend, tmp_path):
    source = tmp_path / "source"
    filled(make_manager, backend, source, checkpoints=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    os.symlink(empty, link)
    with pytest.raises(CheckpointError, match=rf"copy target '{link}' is a symbolic link"):
        copy_buffer(source, link)
    assert os.readlink(link) == str(empty) and not list(empty.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "source"]
    assert Path(copy_buffer(source, empty)) == empty
    copied = make_manager(backend=backend, checkpoint_dir=str(empty), capacity=100)
    copied.load_replay_buffer()
    assert copied.num_frames() == 3


@pytest.mark.parametrize("start", ["create", "load"])
def test_a_looping_checkpoint_dir_link_is_a_clear_error(make_manager, backend, tmp_path, start):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    for checkpoint_dir in (loop, loop / "inner"):
        manager = make_manager(backend=backend, checkpoint_dir=str(checkpoint_dir))
        with pytest.raises(CheckpointError, match=rf"'{checkpoint_dir}' cannot be resolved.*loops"):
            if start == "create":
                manager.create_replay_buffer()
            else:
                manager.load_replay_buffer()
        manager.close()
    assert os.readlink(loop) == str(loop)


def test_an_export_prefix_with_a_nul_byte_is_a_config_error(make_manager, backend, tmp_path):
    manager = make_manager(backend=backend, checkpoint_dir=str(tmp_path / "ckpt"))
    manager.create_replay_buffer()
    write_items(manager, 0, 3)
    target = tmp_path / "export"
    with pytest.raises(ConfigError, match=r"NUL characters, got 'a\\x00b'"):
        manager.export(target, prefix="a\0b")
    assert not target.exists()
    with pytest.raises(ConfigError, match="export directory .* holds a NUL character"):
        manager.export(f"{tmp_path}/bad\0dir")
    manager.export(target, prefix="a")
    fresh = make_manager(backend=backend, checkpoint_dir=str(tmp_path / "fresh"))
    with pytest.raises(ConfigError, match=r"NUL characters, got 'a\\x00'"):
        fresh.import_buffer(target, prefix="a\0")
    fresh.import_buffer(target, prefix="a")
    assert fresh.num_frames() == 3


@pytest.mark.parametrize("choice", [*BACKENDS, "auto"])
def test_a_nul_byte_in_checkpoint_dir_or_a_copy_path_is_a_config_error(
    make_manager, data_spec, tmp_path, choice
):
    bad = f"{tmp_path}/a\0b"
    with pytest.raises(ConfigError, match=r"checkpoint_dir '.*a\\x00b' holds a NUL character"):
        ReplayBufferManager(data_spec, 100, checkpoint_dir=bad, backend=choice)
    if choice == "auto":
        return
    source = tmp_path / "source"
    filled(make_manager, choice, source, checkpoints=1)
    before = without_lock(tree_digest(source))
    with pytest.raises(ConfigError, match=r"copy target '.*a\\x00b' holds a NUL character"):
        copy_buffer(source, bad)
    with pytest.raises(ConfigError, match=r"copy source '.*source\\x00' holds a NUL character"):
        copy_buffer(f"{source}\0", tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    assert without_lock(tree_digest(source)) == before


def test_a_checkpoint_name_of_other_digits_is_not_a_checkpoint(make_manager, backend, tmp_path):
    root = tmp_path / "ckpt"
    frames = filled(make_manager, backend, root, checkpoints=1)
    (root / CHECKPOINTS / "ckpt-\u00b2").mkdir()  # str.isdigit() takes "²", int() does not
    manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
    manager.load_replay_buffer()
    assert manager.num_frames() == frames
    assert (root / CHECKPOINTS / "ckpt-\u00b2").is_dir()


def test_a_path_option_that_is_no_path_is_a_config_error(data_spec, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint_dir must be a path .*got 5 \(int\)"):
        ReplayBufferManager(data_spec, 100, checkpoint_dir=5)
    with pytest.raises(ConfigError, match=r"summary_dir '.*s\\x00' holds a NUL character"):
        ReplayBufferManager(data_spec, 100, tmp_path / "c", summary_dir=f"{tmp_path}/s\0")
    with pytest.raises(ConfigError, match=r"copy target must be a path .*got 7 \(int\)"):
        copy_buffer(tmp_path / "c", 7)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ file modes


def test_files_get_explicit_modes_under_umask_000(make_manager, backend, tmp_path):
    root = tmp_path / "deep" / "ckpt"
    export = tmp_path / "export"
    copy = tmp_path / "runs" / "exp1" / "copy"  # its missing parents get the modes too
    old = os.umask(0)
    try:
        manager = make_manager(backend=backend, checkpoint_dir=str(root), capacity=100)
        manager.create_replay_buffer()
        write_items(manager, 0, 3)
        manager.checkpoint()
        manager.export(export)
        manager.close()
        copy_buffer(root, copy)
    finally:
        os.umask(old)
    modes = {}
    for top in (tmp_path / "deep", export, tmp_path / "runs"):
        modes[str(top)] = stat.S_IMODE(os.lstat(top).st_mode)
        for directory, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(directory, name)
                modes[path] = stat.S_IMODE(os.lstat(path).st_mode)
    files = {p: m for p, m in modes.items() if os.path.isfile(p)}
    dirs = {p: m for p, m in modes.items() if os.path.isdir(p)}
    assert {os.path.basename(p) for p in files} >= {
        "replay_service.json",
        ".lock",
        CHECKPOINT_META,
        "DONE",
        "buffer_state.safetensors",
        "buffer_metadata.json",
    }
    assert {p: oct(m) for p, m in files.items() if m != 0o640} == {}
    assert {p: oct(m) for p, m in dirs.items() if m != 0o750} == {}
