"""tracegym SDK: ``tg.reward``, ``tg.emit``, ``tg.rollout``. Imports nothing heavy (httpx only).

    import tracegym as tg

    with tg.rollout(task_id="t1"):          # or @tg.rollout() on the agent function
        ...                                 # httpx calls to the gateway carry the rollout headers
        tg.reward(1.0)

``tracegym run MODULE:FUNCTION`` calls ``FUNCTION(task_input, base_url)`` inside such a scope for each
queued rollout (the call convention: ``tracegym.runner``).
"""

from __future__ import annotations

from tracegym.client import (
    GatewayError,
    GatewayUnreachableError,
    LeaseLostError,
    RetryPolicy,
    SDKConfig,
    configure,
)
from tracegym.context import (
    NoRolloutError,
    RolloutScope,
    aemit,
    areward,
    current_rollout,
    emit,
    reward,
    rollout,
)

__version__ = "0.1.0"

__all__ = [
    "GatewayError",
    "GatewayUnreachableError",
    "LeaseLostError",
    "NoRolloutError",
    "RetryPolicy",
    "RolloutScope",
    "SDKConfig",
    "__version__",
    "aemit",
    "areward",
    "configure",
    "current_rollout",
    "emit",
    "reward",
    "rollout",
]
