"""What a checkpoint directory records: `StoreMetadata` of its buffer, and each `Checkpoint`.

`replay_service.json` (the store file) and every checkpoint's `replay_service_checkpoint.json`
hold the metadata of the buffer they were written for: the primary table, the data spec, the
extra and variable tables (`TableSummary`, `VariableTableSummary`) and the layout. A load
compares what is stored with what is configured now (`StoreMetadata.check_matches`) and names
every difference. A `Checkpoint` is one checkpoint as its metadata file records it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from replay_service.errors import CheckpointError, SpecMismatchError
from replay_service.specs.nests import FieldDescription, describe_spec, diff_descriptions
from replay_service.storage import formats
from replay_service.storage.checkpoint_format import CheckpointFormat, backend_of_files
from replay_service.storage.files import list_dir

if TYPE_CHECKING:
    from replay_service.config.options import TableConfig, VariableTableConfig

FORMAT = formats.STORE.tag


@dataclasses.dataclass(frozen=True)
class TableSummary:
    """What is recorded of a table served next to the primary one.

    Attributes:
      name: Table name.
      sequence_length: Steps per item.
      capacity: Maximum number of items.
    """

    name: str
    sequence_length: int
    capacity: int


@dataclasses.dataclass(frozen=True)
class VariableTableSummary:
    """What is recorded of a variable-container table (see `config.VariableTableConfig`).

    Attributes:
      name: Table name.
      spec: Field descriptions of its signature, from `specs.describe_spec`.
    """

    name: str
    spec: list[FieldDescription]


@dataclasses.dataclass(frozen=True)
class StoreMetadata:
    """What a checkpoint directory holds, checked on every restore.

    Attributes:
      table_name: Name of the primary Reverb table.
      sequence_length: Steps per item of the primary table.
      capacity: Maximum number of items of the primary table that was checkpointed.
      data_spec: Field descriptions from `specs.describe_spec` (shared by every table).
      extra_tables: The other tables of the same server, in order. Files written before
        several tables were supported have no such field: they hold none.
      pad_end_of_episode: Whether items are padded `Masked` sequences (`sequences.py`), for
        every table.
      variable_tables: The variable-container tables of the same server, each with its own
        spec. Files written before they were supported have no such field: they hold none.
      layout: The storage layout of every replay table ("nested" or "packed", see
        `config.TableConfig`); files without the field hold nested tables.
      frame_stack: Frames per stacked observation, each stored once (`config.TableConfig`),
        and the axis they are stacked along; files without the fields hold none.
    """

    table_name: str
    sequence_length: int
    capacity: int
    data_spec: list[FieldDescription]
    extra_tables: tuple[TableSummary, ...] = ()
    pad_end_of_episode: bool = False
    variable_tables: tuple[VariableTableSummary, ...] = ()
    layout: str = "nested"
    frame_stack: int | None = None
    frame_axis: int = 0

    @classmethod
    def for_tables(
        cls,
        table: TableConfig,
        data_spec: Any,
        extra_tables: Sequence[TableConfig] = (),
        variable_tables: Sequence[VariableTableConfig] = (),
    ) -> StoreMetadata:
        """The metadata of a server holding `table` (primary), `extra_tables` and
        `variable_tables`.

        Args:
          table: The primary table.
          data_spec: Per-step data spec of every replay table.
          extra_tables: The other replay tables, in order.
          variable_tables: The variable-container tables, in order.

        Returns:
          The metadata to record and compare on restore.
        """
        return cls(
            table_name=table.name,
            sequence_length=table.sequence_length,
            capacity=table.capacity,
            data_spec=describe_spec(data_spec),
            extra_tables=tuple(
                TableSummary(name=t.name, sequence_length=t.sequence_length, capacity=t.capacity)
                for t in extra_tables
            ),
            pad_end_of_episode=table.pad_end_of_episode,
            variable_tables=tuple(
                VariableTableSummary(name=v.name, spec=describe_spec(v.spec))
                for v in variable_tables
            ),
            layout=table.layout,
            frame_stack=table.frame_stack,
            frame_axis=table.frame_axis,
        )

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form, tagged with the layout format."""
        data = dataclasses.asdict(self)
        data["extra_tables"] = [dataclasses.asdict(t) for t in self.extra_tables]
        data["variable_tables"] = [dataclasses.asdict(t) for t in self.variable_tables]
        if self.frame_stack is None:  # as files written before frame stacks
            del data["frame_stack"], data["frame_axis"]
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> StoreMetadata:
        """Parses `to_json` output; a missing `extra_tables` or `variable_tables` field means
        no such tables.

        Raises:
          UnknownFormatError: If the format tag is unknown or of a newer version (not damage).
          CheckpointError: If the format tag or a field is missing or wrong.
        """
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} is not a {FORMAT} file: {type(data).__name__}")
        formats.STORE.check(data.get("format"), source)
        try:
            return cls(
                table_name=str(data["table_name"]),
                sequence_length=int(data["sequence_length"]),
                capacity=int(data["capacity"]),
                data_spec=list(data["data_spec"]),
                extra_tables=tuple(
                    TableSummary(
                        name=str(t["name"]),
                        sequence_length=int(t["sequence_length"]),
                        capacity=int(t["capacity"]),
                    )
                    for t in data.get("extra_tables", [])
                ),
                pad_end_of_episode=bool(data.get("pad_end_of_episode", False)),
                variable_tables=tuple(
                    VariableTableSummary(name=str(t["name"]), spec=list(t["spec"]))
                    for t in data.get("variable_tables", [])
                ),
                layout=str(data.get("layout", "nested")),
                frame_stack=(None if data.get("frame_stack") is None else int(data["frame_stack"])),
                frame_axis=int(data.get("frame_axis", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source} is malformed: {e!r}") from e

    def differences(self, requested: StoreMetadata) -> list[str]:
        """Names every field where `requested` (the caller's) differs from this (stored) one.

        Capacity counts as a difference: Reverb restores the stored capacity and ignores the
        table it is given, so a restore with another capacity would silently keep the old one.
        The extra tables must be the same set of names with the same capacity and sequence
        length each; the variable tables the same set of names with the same spec each.
        """
        problems = [
            f"{name}: requested {getattr(requested, name)!r}, stored {getattr(self, name)!r}"
            for name in ("table_name", "sequence_length", "pad_end_of_episode", "capacity")
            if getattr(requested, name) != getattr(self, name)
        ]
        if requested.capacity != self.capacity:
            problems[-1] += (
                f" (Reverb restores the stored capacity; use capacity={self.capacity}, or "
                "export and import the buffer to resize it)"
            )
        if requested.layout != self.layout:
            problems.append(
                f"layout: requested {requested.layout!r}, stored {self.layout!r} (the stored "
                f"items are {self.layout}; use layout={self.layout!r}, or export the buffer and "
                "import it into one of the other layout)"
            )
        if (requested.frame_stack, requested.frame_axis) != (self.frame_stack, self.frame_axis):
            problems.append(
                f"frame_stack: requested {requested.frame_stack!r} (frame_axis "
                f"{requested.frame_axis!r}), stored {self.frame_stack!r} (frame_axis "
                f"{self.frame_axis!r}) (use the stored frame_stack, or export the buffer and "
                "import it into one with the other)"
            )
        problems += _extra_table_differences(requested.extra_tables, self.extra_tables)
        problems += [
            f"data_spec {p}" for p in diff_descriptions(requested.data_spec, self.data_spec)
        ]
        problems += _variable_table_differences(requested.variable_tables, self.variable_tables)
        return problems

    def check_matches(self, requested: StoreMetadata, where: str) -> None:
        """Refuses to load this (stored) metadata into a buffer configured as `requested`.

        Args:
          requested: The metadata of the configured tables and data spec.
          where: The file or checkpoint this metadata was read from (named in the error).

        Raises:
          SpecMismatchError: If any field differs (`differences`), naming `where` and each
            difference.
        """
        problems = self.differences(requested)
        if problems:
            raise SpecMismatchError(
                f"{where} does not match the configured table: " + "; ".join(problems)
            )


def _by_name(
    kind: str, requested: Sequence[Any], stored: Sequence[Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Both lists of tables by name, and the difference of their name sets (if any)."""
    wanted = {t.name: t for t in requested}
    found = {t.name: t for t in stored}
    problems = []
    if wanted.keys() != found.keys():
        problems.append(
            f"{kind}: requested {sorted(wanted)}, stored {sorted(found)} (missing from the "
            f"checkpoint: {sorted(wanted.keys() - found.keys())}; not requested: "
            f"{sorted(found.keys() - wanted.keys())})"
        )
    return wanted, found, problems


def _extra_table_differences(
    requested: Sequence[TableSummary], stored: Sequence[TableSummary]
) -> list[str]:
    wanted, found, problems = _by_name("extra_tables", requested, stored)
    for name in sorted(wanted.keys() & found.keys()):
        for field in ("sequence_length", "capacity"):
            want, have = getattr(wanted[name], field), getattr(found[name], field)
            if want != have:
                problems.append(
                    f"extra table {name!r} {field}: requested {want!r}, stored {have!r}"
                )
    return problems


def _variable_table_differences(
    requested: Sequence[VariableTableSummary], stored: Sequence[VariableTableSummary]
) -> list[str]:
    wanted, found, problems = _by_name("variable_tables", requested, stored)
    for name in sorted(wanted.keys() & found.keys()):
        problems += [
            f"variable table {name!r} spec {p}"
            for p in diff_descriptions(wanted[name].spec, found[name].spec)
        ]
    return problems


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint.

    Attributes:
      path: Directory holding the checkpoint files.
      sequence: Position in the store; higher is newer.
      info: Contents of its `replay_service_checkpoint.json`.
      formats: The checkpoint formats of the store that read it (`CheckpointStore`): what
        tells which backend wrote it where that is not recorded.
    """

    path: str
    sequence: int
    info: dict[str, Any]
    formats: Sequence[CheckpointFormat] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def metadata(self) -> StoreMetadata:
        """The store metadata recorded with this checkpoint."""
        return StoreMetadata.from_json(self.info.get("store", {}), self.path)

    @property
    def num_items(self) -> int | None:
        """Items recorded at checkpoint (every table), or None if unknown."""
        value = self.info.get("num_items")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def files(self) -> dict[str, Any] | None:
        """Size and SHA-256 of each data file, recorded at checkpoint; None for checkpoints
        written before files were verified (their files are read back in full on load)."""
        files = self.info.get("files")
        return files if isinstance(files, dict) else None

    @property
    def backend(self) -> str | None:
        """The backend that wrote it ("reverb", "local"): as recorded, else (checkpoints written
        before the field existed) as its recorded or present files show; None if none of
        `formats` owns them (or `formats` is empty)."""
        recorded = self.info.get("backend")
        if recorded in [f.backend for f in self.formats]:
            return recorded
        files = self.files
        return backend_of_files(
            self.formats, list(files) if files is not None else list_dir(self.path)
        )
