"""The trainer loops a config can select with ``training.recipe``.

Each entry is ``fn(cfg: Config, info: DistInfo) -> int`` (the exit status).
Algorithms inside a loop are registry entries too (rl/algorithms); a recipe is
a loop shape (supervised, preference, rollout-then-update), not an algorithm.
"""

from __future__ import annotations

from rl.registry import Registry

TRAINERS: Registry = Registry("training recipe")


@TRAINERS.register("sft")
def _sft(cfg, info) -> int:
    from rl.sft import run_sft

    return run_sft(cfg, info)
