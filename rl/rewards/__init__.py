"""Reward functions (registered by name) and the process pool that scores them.

Importing this package registers the built-in rewards: "math" (rl.rewards.math);
"exact_match", "format", "length_penalty", "sequence", "countdown"
(rl.rewards.basic); "code_unit_tests" (rl.rewards.code, sandboxed unit tests).
See ``rl.rewards.registry`` for the reward-function contract;
``rl.workers.reward_pool.RewardPool`` scores batches in worker processes.
"""

from rl.rewards import basic, code, math  # noqa: F401  (registers the built-ins)
from rl.rewards.registry import (
    REWARDS,
    RewardFn,
    get_reward,
    load_reward_modules,
    register_reward,
)

__all__ = [
    "REWARDS",
    "RewardFn",
    "get_reward",
    "load_reward_modules",
    "register_reward",
]
