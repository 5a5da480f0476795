"""Exceptions raised by replay_service.

Every error names the offending value so a user can act on it without reading the source.
All of them derive from `ReplayServiceError`, so callers can catch the whole family at once.
"""


class ReplayServiceError(Exception):
    """Base class of every error raised by replay_service."""


class ConfigError(ReplayServiceError, ValueError):
    """A configuration value is invalid (capacity <= 0, an unknown sampler, a bad key...)."""


class SpecMismatchError(ReplayServiceError, ValueError):
    """Data does not match the buffer's data spec, sequence length or table."""


class CheckpointError(ReplayServiceError):
    """A checkpoint directory is missing, foreign, empty, corrupt or already in use."""


class CheckpointExistsError(CheckpointError):
    """`create_replay_buffer()` was asked to start over a directory that holds checkpoints."""


class NoCheckpointError(CheckpointError):
    """`load_replay_buffer()` found no complete checkpoint to restore."""


class BackendMismatchError(CheckpointError):
    """A checkpoint was written by the other backend ("reverb" or "local"); nothing is moved."""


class UnknownFormatError(CheckpointError):
    """A file's format tag is unknown, or of a newer version than this replay_service reads.

    The file is not damaged: it is refused and left in place, never moved to `corrupt/`
    (see `storage.formats`).
    """


class NotRegularFileError(CheckpointError):
    """A path where replay_service reads or writes one of its files holds something else (a
    named pipe, a socket, a device, a directory or a symbolic link); it is never opened, moved
    or deleted."""


class ServerError(ReplayServiceError):
    """The Reverb server could not be started or reached."""


class PortInUseError(ServerError):
    """The requested port is already bound by another process."""


class ServerUnavailableError(ServerError):
    """No Reverb server answered at the address within the timeout."""


class WriteTimeoutError(ReplayServiceError, TimeoutError):
    """Written items were not confirmed by the server within the timeout."""


class ManagerClosedError(ReplayServiceError, RuntimeError):
    """The manager (or an object it handed out) was used after `close()`."""


class BufferStateError(ReplayServiceError, RuntimeError):
    """An operation was called in the wrong order (e.g. sampling before a buffer exists)."""


class SampleTimeoutError(ReplayServiceError, TimeoutError):
    """No item could be sampled within the timeout (empty table, rate limiter, server gone)."""
