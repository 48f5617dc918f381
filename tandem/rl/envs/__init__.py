"""Environments for multi-turn (agentic) rollouts, selected by name from a config.

Importing this package registers the built-ins in ``ENVIRONMENTS``: "tool"
(tool calls, then a scored answer; tandem/rl/envs/tool_env.py) and "code" (write a
function, optionally test it with python, scored by hidden unit tests;
tandem/rl/envs/code_env.py). The contract is in tandem/rl/envs/base.py, the worker pool that
runs steps next to generation in tandem/rl/workers/env_pool.py, the driver in
tandem/rl/rollout/agentic.py. Nothing here imports torch, so pool workers start quickly.
"""

from tandem.rl.envs import code_env, tool_env  # noqa: F401  (registers the built-ins)
from tandem.rl.envs.base import (
    ENVIRONMENTS,
    Environment,
    Episode,
    StepResult,
    make_env,
    row_messages,
    step_episode,
)

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Episode",
    "StepResult",
    "make_env",
    "row_messages",
    "step_episode",
]
