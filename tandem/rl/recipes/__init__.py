"""Recipes: what one training step does, selected by ``training.recipe``.

Each entry makes a recipe object (tandem/rl/recipes/base.py) from the config; the one
shell (tandem/rl/recipes/loop.py) runs it. A recipe is a step shape (supervised,
pairwise, rollout-then-update), not an algorithm: algorithms are registry
entries inside it (tandem/rl/algorithms). ``sections`` are the config sections the
recipe reads beyond the shared ones; a key set in any other section draws a
warning naming it (see `unused_settings`).

    sft.py           supervised fine-tuning (packed chat data)
    pairwise.py      the pairwise step shared by dpo.py (DPO, IPO, SimPO) and reward_model.py
    rl.py            rollout then update (GRPO, PPO, DAPO, GSPO, RLOO, REINFORCE++, OPD, agentic)
    loop.py          the shell: resume, checkpoints, preemption, watchdog, NaN policy, metrics,
                     eval, export
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tandem.rl.core.registry import Registry

SHARED_SECTIONS = (
    "job",
    "model",
    "data",
    "optimizer",
    "lr_schedule",
    "training",
    "parallel",
    "checkpoint",
    "metrics",
    "fault",
    "plan",
    "lora",
    "advanced",
)


@dataclass(frozen=True)
class RecipeEntry:
    factory: str  # "module:function" making the recipe from (cfg, Runtime); imported when chosen
    sections: tuple[str, ...]  # config sections read beyond SHARED_SECTIONS
    # the held-out metric and its direction (tandem-sweep's default objective)
    objective: tuple[str, str]

    def make(self) -> Any:
        module, name = self.factory.split(":")
        return getattr(importlib.import_module(module), name)


RECIPES: Registry[RecipeEntry] = Registry("training recipe")
_ACCURACY = ("eval/accuracy", "maximize")
RECIPES.register("sft")(
    RecipeEntry("tandem.rl.recipes.sft:make_sft", (), ("eval/loss", "minimize"))
)
RECIPES.register("dpo")(RecipeEntry("tandem.rl.recipes.dpo:make_dpo", ("preference",), _ACCURACY))
RECIPES.register("reward_model")(
    RecipeEntry("tandem.rl.recipes.reward_model:make_reward_model", ("preference",), _ACCURACY)
)
RECIPES.register("rl")(
    RecipeEntry(
        "tandem.rl.recipes.rl:make_rl",
        ("rl", "rollout", "reward", "critic", "distill", "env"),
        _ACCURACY,
    )
)


def unused_settings(cfg: Any) -> list[str]:
    """Keys set to a non-default value in a section the chosen recipe does not read."""
    from tandem.rl.config.schema import Config
    from tandem.rl.core.configlib import to_dict

    used = set(SHARED_SECTIONS) | set(RECIPES.get(cfg.training.recipe).sections)
    default, now = to_dict(Config()), to_dict(cfg)
    out = []
    for section, values in now.items():
        if section in used:
            continue
        for key, value in values.items():
            if value != default[section][key]:
                out.append(f"{section}.{key}")
    return out


def run(cfg: Any, info: Any) -> int:
    """Run the configured recipe in the shell, every kernel as ``advanced.kernels`` picks;
    returns the exit status."""
    from tandem.kernels.dispatch import chosen_kernels, set_kernels
    from tandem.rl.generator.compiled_decode import process_choice, set_compile_decode
    from tandem.rl.recipes.loop import run_recipe

    before, compiling = chosen_kernels(), process_choice()
    set_kernels(cfg.advanced.kernels)
    set_compile_decode(cfg.advanced.compile_decode, cfg.training.steps * cfg.rollout.max_tokens)
    try:
        return run_recipe(RECIPES.get(cfg.training.recipe).make(), cfg, info)
    finally:
        set_kernels(before)
        set_compile_decode(*compiling)
