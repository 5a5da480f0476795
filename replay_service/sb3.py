"""Former path of `replay_service.integrations.sb3`, kept for existing imports."""

from replay_service.integrations.sb3 import (  # noqa: F401
    ReverbReplayBuffer,
    data_spec_for_spaces,
)
