"""Former path of `replay_service.backends.reverb.server`, kept for existing imports."""

from replay_service.backends.reverb.server import (  # noqa: F401
    ADOPT_POLL_S,
    FIRST_CONTACT_STARTS,
    INFO_TIMEOUT_S,
    CheckpointedServer,
    serve_config,
)
