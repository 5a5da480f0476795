"""The format tags of every file replay_service writes, and the tags each format reads.

A tag names a file format and its version, "<name>/<version>". It is a constant of the format,
never derived from a module path: moving code must not change what files say. Each format writes
its original tag, so the oldest releases still read new files, and reads every tag it was ever
written under (`FileFormat.aliases`: module-path tags written between 5033aea and the return of
the original tags).

    STORE            replay_service.checkpoint_dir/1   replay_service.json, and each
                                                      checkpoint's replay_service_checkpoint.json
    LOCAL_CHECKPOINT replay_service.local_checkpoint/1 a local checkpoint's local_checkpoint.json
                     (also read: replay_service.backends.local.checkpoint/1)
    EXPORT           replay_service.export/1           an export's (and a local checkpoint
                                                      table's) metadata.json and the header of
                                                      its state.safetensors
                     (also read: replay_service.storage.export/1)

A file whose tag is unknown, or of a version above the one read here, was written by a newer
replay_service (or another program): it is refused with `UnknownFormatError`, naming the tag
found and the tags this version reads, and is never taken for damage (never moved to
`corrupt/`). A missing or non-text tag is damage (`CheckpointError`).

Changing a format means a new version tag here (and a fixture of the old one under
tests/fixtures/formats/); see docs/operations.md, "File formats".
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

from replay_service.errors import CheckpointError, UnknownFormatError


@dataclasses.dataclass(frozen=True)
class FileFormat:
    """One file format: the tag written now and the tags read.

    Attributes:
      name: The format's name, the part of its tag before "/".
      version: The version written now and the highest one read.
      what: The files of this format, for messages.
      aliases: Other tags once written for this format and version (read, never written).
    """

    name: str
    version: int
    what: str
    aliases: tuple[str, ...] = ()

    @property
    def tag(self) -> str:
        """The tag written now, "<name>/<version>"."""
        return f"{self.name}/{self.version}"

    @property
    def read_tags(self) -> tuple[str, ...]:
        """Every tag read: the written one first, then the aliases."""
        return (self.tag, *self.aliases)

    def reads(self, tag: object) -> bool:
        """Whether a file tagged `tag` is of this format, in a version read here."""
        return tag in self.read_tags

    def check(self, found: object, source: str) -> None:
        """Accepts a file tagged `found` or says why it cannot be read.

        Args:
          found: The file's tag (None if it has none).
          source: The file, named in errors.

        Raises:
          UnknownFormatError: If `found` is a tag this version does not read: a newer version of
            this format, or an unknown format. The file is not damaged; nothing may move it.
          CheckpointError: If `found` is missing or not a string (the file is damaged).
        """
        if self.reads(found):
            return
        if not isinstance(found, str) or not found:
            raise CheckpointError(
                f"{source} is not a {self.what} file: it has no format tag (format: {found!r}; "
                f"expected {self.tag!r})"
            )
        reads = ", ".join(repr(t) for t in self.read_tags)
        here = f"replay_service {installed_version()}"
        name, _, version = found.rpartition("/")
        names = {t.rpartition("/")[0] for t in self.read_tags}
        # Compared as digits, not converted: Python refuses to convert thousands of digits.
        number = version.lstrip("0") or "0"
        newer = (
            version.isascii()
            and version.isdigit()
            and (len(number), number) > (len(str(self.version)), str(self.version))
        )
        if name in names and newer:
            raise UnknownFormatError(
                f"{source} is a {self.what} file of format {found!r}, version {number}, "
                f"written by a newer replay_service; {here} reads version {self.version} "
                f"({reads}). Upgrade replay_service to a release that reads {found!r}; the "
                "file is not damaged and was left as it is"
            )
        raise UnknownFormatError(
            f"{source} has format {found!r}, which {here} does not know ({self.what} files are "
            f"read as {reads}): it was written by a newer replay_service or by another program. "
            f"Upgrade replay_service to a release that reads {found!r}; the file is not damaged "
            "and was left as it is"
        )


STORE = FileFormat(
    name="replay_service.checkpoint_dir",
    version=1,
    what="replay_service checkpoint directory metadata",
)
LOCAL_CHECKPOINT = FileFormat(
    name="replay_service.local_checkpoint",
    version=1,
    what="local-backend checkpoint index",
    aliases=("replay_service.backends.local.checkpoint/1",),
)
EXPORT = FileFormat(
    name="replay_service.export",
    version=1,
    what="replay_service export",
    aliases=("replay_service.storage.export/1",),
)

FORMATS: tuple[FileFormat, ...] = (STORE, LOCAL_CHECKPOINT, EXPORT)
"""Every file format replay_service writes."""


def installed_version() -> str:
    """The installed replay_service's version ("unknown" if it is not installed)."""
    try:
        return importlib.metadata.version("replay_service")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
