"""Former path of `replay_service.config.files`, kept for existing imports."""

from replay_service.config.files import (  # noqa: F401
    DEFAULT_PORT,
    DataSpecConfig,
    ServerConfig,
    ServiceConfig,
    load_config,
    read_toml,
)
