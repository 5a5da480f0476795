"""Former home of the Reverb backend's tf.data sampling, kept for existing imports.

Its code lives by job in `liveness` (the server watch, `Lifeline`, `liveness_bound`),
`sampling_errors` (what a dataset raises instead of ending, `bound_sampling`), `pipeline`
(`read_pipeline`, `sample_dataset`), `mixing` (`mixed_dataset`) and `tf_agents_buffer`
(`ReplayBuffer`); this module re-exports the public names it had.
"""

from replay_service.backends.reverb.liveness import (  # noqa: F401
    DEFAULT_GRACE_S,
    MANAGER_CLOSED_MESSAGE,
    MAX_CHECK_INTERVAL_S,
    MAX_PACE_S,
    MIN_CHECK_INTERVAL_S,
    MIN_PACE_S,
    SERVER_LOST_MESSAGE,
    Lifeline,
    LivenessRules,
    guard_liveness,
    liveness_bound,
    python_calls_stopped,
)
from replay_service.backends.reverb.mixing import mixed_dataset  # noqa: F401
from replay_service.backends.reverb.pipeline import (  # noqa: F401
    default_in_flight,
    read_pipeline,
    sample_dataset,
)
from replay_service.backends.reverb.sampling_errors import (  # noqa: F401
    EMPTY_BUFFER_MESSAGE,
    FOREIGN_ITEM_ERROR,
    bound_sampling,
    foreign_item_message,
    raise_when_exhausted,
    replay_service_message,
    sampling_timeout_message,
)
from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer  # noqa: F401
