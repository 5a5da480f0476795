"""The one import surface of what replay_service knows about Reverb's private formats and behaviour.

The code lives in `replay_service.backends.reverb.platform`, one module per format or job:
`version.py` (the Reverb releases it was verified on, `require_supported_reverb`),
`checkpoint_files.py` (the checkpoint files and their verification; `CHECKPOINT_FORMAT`, what the
store knows of them), `saves.py` (a save's cleanup and its races), `restore.py` (the restore view
with the table options configured now), `draining.py` (reading every item of a checkpoint once,
for export), `sockets.py` (stopping confirmations by shutting down a server's connections),
`bare_roots.py` (bare Reverb checkpoint roots and their tables), `writers.py` (a writer whose
destructor would wait forever) and `tf_iterators.py` (TensorFlow's iterator internals).
Callers import these names from here.
"""

from replay_service.backends.reverb.platform.bare_roots import (  # noqa: F401
    ColumnType,
    StoredTable,
    bare_checkpoint_dirs,
    bare_checkpoints,
    copy_with_signature,
    read_column_types,
    read_stored_tables,
)
from replay_service.backends.reverb.platform.checkpoint_files import (  # noqa: F401
    CHECKPOINT_FORMAT,
    CHUNKS_FILE,
    DATA_FILES,
    ITEMS_FILE,
    TABLES_FILE,
    is_reverb_checkpoint,
    verify_files,
)
from replay_service.backends.reverb.platform.draining import (  # noqa: F401
    read_checkpoint_items,
)
from replay_service.backends.reverb.platform.restore import (  # noqa: F401
    apply_options,
    lowers_max_times_sampled,
    rebased_sample_count,
    restore_view,
)
from replay_service.backends.reverb.platform.saves import (  # noqa: F401
    SAVE_SETTLE_S,
    is_concurrent_save_error,
    retry_concurrent_save,
)
from replay_service.backends.reverb.platform.sockets import (  # noqa: F401
    close_foreign_connections,
    own_client_ports,
)
from replay_service.backends.reverb.platform.tf_iterators import (  # noqa: F401
    flat_getter,
    numpy_view,
)
from replay_service.backends.reverb.platform.version import (  # noqa: F401
    SUPPORTED_REVERB,
    require_supported_reverb,
)
from replay_service.backends.reverb.platform.writers import (  # noqa: F401
    abandon_writer,
)
