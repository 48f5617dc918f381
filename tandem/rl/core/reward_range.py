"""The range every reward must lie in, checked where a reward enters the run.

Rewards are summed (per-turn rewards of an episode, weighted reward functions, the
environment's) and then turned into advantages in float32, whose largest finite value is
about 3.4e38: a reward of 1e39 is finite in Python's float64 and inf in float32, and two
per-turn rewards of 3e38 overflow when summed. Every reward (a reward function's result,
an environment's, a harness's ``/rl/set_reward``) is therefore a number within
``[-REWARD_LIMIT, REWARD_LIMIT]``, and an episode's per-turn rewards must sum to one too;
squared and summed over a batch such values stay far from float32's limit.
A value outside is a counted bad reward, or a 400 to a harness; never a NaN mid-run.
"""

from __future__ import annotations

import math
from typing import Any

REWARD_LIMIT = 1e6


def reward_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a reward (one phrase), or None. Integers of any size (JSON's
    400-digit ones) are compared exactly, never converted to float first."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value}"
    if not -REWARD_LIMIT <= value <= REWARD_LIMIT:
        shown = (
            f"{value:.3g}"
            if isinstance(value, float)
            else f"an integer of {len(str(abs(value)))} digits"
        )
        return f"must lie in [-{REWARD_LIMIT:g}, {REWARD_LIMIT:g}], got {shown}"
    return None
