"""The lock that one serving process holds on its checkpoint directory: `ServedDirectory`.

`DirectoryLock` is an exclusive, process-wide `filelock.FileLock` on `<checkpoint_dir>/.lock`,
taken without waiting. The file holds the holder's pid (named when another process is refused),
is never a symbolic link (refused, never followed), and is compared with the locked file
descriptor, so a directory removed or replaced while it is served is noticed (`in_place`).
`ServedDirectory` is a `CheckpointDirectory` that takes that lock (`lock`, `locked`, `serving`)
after checking that the directory resolves and holds no link where replay_service writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator, Sequence

import filelock

from replay_service.errors import CheckpointError
from replay_service.storage.checkpoint_format import CheckpointFormat
from replay_service.storage.directory import LOCK_FILE, CheckpointDirectory
from replay_service.storage.file_modes import FILE_MODE, make_dirs, regular_file_exists


class DirectoryLock:
    """The lock on the checkpoint directory `root`, held through the file `path`.

    Args:
      root: The checkpoint directory (named in errors).
      path: The lock file inside it.
    """

    def __init__(self, root: str, path: str) -> None:
        self.root = root
        self.path = path
        self._lock: filelock.BaseFileLock | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock is not None

    def acquire(self, check: Callable[[], None]) -> None:
        """Takes the lock (the directory must exist); it does not wait for another holder.

        Args:
          check: Runs once the lock is held; if it raises, the lock is released again.

        Raises:
          CheckpointError: If another process (or manager) holds it, the lock file is not a
            regular file (a symbolic link is refused, never followed) or was replaced while it
            was taken; whatever `check` raises (an `OSError` wrapped).
        """
        if self._lock is not None:
            return
        path = self.path
        refuse_symlink(path)
        acquired: list[int] = []
        lock = filelock.FileLock(
            path,
            timeout=0,
            mode=FILE_MODE,
            thread_local=False,
            fallback_to_soft=False,
            preserve_lock_file=True,
            on_acquired=acquired.append,
        )
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CheckpointError(
                f"checkpoint_dir {self.root!r} is in use by another buffer (lock held by pid "
                f"{lock_holder(path)}); close it first or choose another checkpoint_dir"
            ) from None
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(path):
                refuse_symlink(path)
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
        fd = acquired[-1] if acquired else None
        try:
            if fd is not None:
                if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                    raise CheckpointError(
                        f"{path!r} was replaced while it was being locked; try again"
                    )
                with contextlib.suppress(OSError):  # the pid is only for the message above
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.write(fd, str(os.getpid()).encode())
            check()
        except BaseException as e:
            lock.release(force=True)
            if isinstance(e, OSError):
                raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
            raise
        self._lock = lock
        self._fd = fd

    def release(self) -> None:
        """Releases the lock (no-op if not held)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock.release(force=True)
            self._lock = None
            self._fd = None

    def in_place(self) -> bool:
        """Whether the lock file is still the one locked (the directory was neither removed
        nor replaced since); True where the locked descriptor is unknown."""
        try:
            return self._fd is None or os.path.samestat(os.fstat(self._fd), os.lstat(self.path))
        except OSError:
            return False


class ServedDirectory(CheckpointDirectory):
    """A checkpoint directory that this process may lock to serve a buffer from it.

    Args:
      root: The user's `checkpoint_dir`.
      formats: As `CheckpointDirectory`.
    """

    def __init__(
        self, root: str | os.PathLike[str], formats: Sequence[CheckpointFormat] | None = None
    ) -> None:
        super().__init__(root, formats)
        self._lock = DirectoryLock(self.root, os.path.join(self.root, LOCK_FILE))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the directory's lock for the duration of the block (see `lock`)."""
        self.lock()
        try:
            yield
        finally:
            self.unlock()

    @contextlib.contextmanager
    def serving(self, on_error: Callable[[], None] | None = None) -> Iterator[None]:
        """Takes the directory's lock (see `lock`) for a buffer that starts in the block.

        The lock stays held when the block succeeds (the buffer's `unlock` releases it). If the
        block raises, `on_error()` (if given) runs first, to stop what started, then the lock is
        released and the error propagates.

        Args:
          on_error: Called while the lock is still held when the block fails.

        Raises:
          CheckpointError: If the directory cannot be locked (see `lock`).
        """
        self.lock()
        try:
            yield
        except BaseException:
            if on_error is not None:
                on_error()
            self.unlock()
            raise

    def lock(self) -> None:
        """Takes an exclusive, process-wide lock on the directory (`DirectoryLock`: a
        `filelock.FileLock` on `.lock`, which holds the holder's pid); it does not wait for
        another holder. Its own directories are checked once it is held (`check_own_dirs`).

        Raises:
          CheckpointError: If another process (or manager) serves this directory, or `.lock`
            is not a regular file (a symbolic link is refused, never followed).
        """
        if self._lock.held:
            return
        self.check_root()
        try:
            make_dirs(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
        self._lock.acquire(self.check_own_dirs)

    def unlock(self) -> None:
        """Releases the lock taken by `lock` (no-op if not held)."""
        self._lock.release()


def refuse_symlink(path: str) -> None:
    """Raises `CheckpointError` if the lock file `path` is a symbolic link (never followed),
    and `NotRegularFileError` if it is another kind of file (a named pipe...)."""
    if os.path.islink(path):
        raise CheckpointError(
            f"{path!r} is a symbolic link; replay_service writes its lock there and "
            "never follows links: remove it"
        )
    regular_file_exists(path)


def lock_holder(path: str) -> str:
    """The pid written in the lock file `path`, or "unknown"."""
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return "unknown"
    try:
        data = os.read(fd, 64)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").strip() or "unknown"
