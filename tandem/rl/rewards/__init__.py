"""Reward functions (registered by name) and the process pool that scores them.

Importing this package registers the built-in rewards: "math" (tandem.rl.rewards.math);
"exact_match", "format", "length_penalty", "sequence", "countdown"
(tandem.rl.rewards.basic); "code_unit_tests" (tandem.rl.rewards.code, sandboxed unit tests);
"by_source" (tandem.rl.rewards.routing: the function a row's data_source names).
See ``tandem.rl.rewards.registry`` for the reward-function contract;
``tandem.rl.workers.reward_pool.RewardPool`` scores batches in worker processes.
"""

from tandem.rl.rewards import basic, code, math, routing  # noqa: F401  (registers the built-ins)
from tandem.rl.rewards.registry import (
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
