"""The trainer loops a config can select with ``training.recipe``.

Each entry is ``fn(cfg: Config, info: DistInfo) -> int`` (the exit status).
Algorithms inside a loop are registry entries too (rl/algorithms); a recipe is
a loop shape (supervised, preference, rollout-then-update), not an algorithm.
"""

from __future__ import annotations

from rl.runtime.registry import Registry

TRAINERS: Registry = Registry("training recipe")


@TRAINERS.register("sft")
def _sft(cfg, info) -> int:
    from rl.recipes.sft import run_sft

    return run_sft(cfg, info)


@TRAINERS.register("rl")
def _rl(cfg, info) -> int:
    from rl.recipes.rl import run_rl

    return run_rl(cfg, info)


@TRAINERS.register("dpo")
def _dpo(cfg, info) -> int:
    from rl.recipes.dpo import run_preference

    return run_preference(cfg, info)


@TRAINERS.register("reward_model")
def _reward_model(cfg, info) -> int:
    from rl.recipes.reward_model import run_reward_model

    return run_reward_model(cfg, info)
