"""``rollout.mode``: how the rollout phase is scheduled against the update.

Each entry makes the step's rollout from the synchronous `RolloutPhase` (which owns the
prompts, the generation copy and the scoring) and declares ``streams``: it keeps
sequences in flight across steps, so it needs what that machinery supports so far
(single-turn rollouts, no dynamic sampling, ``parallel.tp = pp = 1``, ``rollout.tp = 1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.rl.core.registry import Registry
from tandem.rl.rollout.phase import RolloutPhase
from tandem.rl.rollout.split import SplitGenerator
from tandem.rl.rollout.streaming import ColocatedAsyncRollout

ROLLOUT_MODES: Registry[Callable[[RolloutPhase], Any]] = Registry("rollout mode")
ROLLOUT_MODES.register("sync", streams=False)(lambda base: base)
ROLLOUT_MODES.register("colocated_async", streams=True)(ColocatedAsyncRollout)
# dedicated generator ranks: a placement of the one RL recipe (tandem/rl/recipes/rl_split.py)
ROLLOUT_MODES.register("split", streams=True, placement="split")(SplitGenerator)
