"""Former path of `replay_service.monitoring.metrics`, kept for existing imports."""

from replay_service.monitoring.metrics import (  # noqa: F401
    DEFAULT_ADDRESS,
    JOIN_TIMEOUT_S,
    MetricsServer,
    start_metrics_server,
)
