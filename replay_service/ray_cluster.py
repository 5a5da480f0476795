"""Former path of `replay_service.distributed.ray_cluster`, kept for existing imports."""

from replay_service.distributed.ray_cluster import (  # noqa: F401
    DEFAULT_COLLECTOR_START_TIMEOUT_S,
    DEFAULT_NUM_CPUS,
    DEFAULT_START_TIMEOUT_S,
    SHARD_DIR_PREFIX,
    Collector,
    RayShards,
    ShardServer,
    start_collector,
    start_shards,
)
