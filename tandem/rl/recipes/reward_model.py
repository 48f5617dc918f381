"""The ``reward_model`` recipe: a Bradley-Terry reward model on the pairwise recipe.

The model is `tandem.models.value_head.ScalarHeadModel`: a transformer trunk (from a
policy HF folder, a reward-model folder, or a from-scratch flavor) with a
scalar head. A pair's score is the head's output at the last real token of
each side (context + reply through the chat template, as tandem/rl/data/preference.py
renders it), and the loss is -log sigmoid(s_chosen - s_rejected)
(tandem/rl/algorithms/preference.py `bradley_terry_loss`), averaged over the step's
pairs with the layout-invariant scaling of tandem/rl/recipes/pairwise.py.

At the end the model is written to ``<dump_folder>/reward_model`` (config.json,
safetensors, tokenizer); `tandem.rl.rollout.reward_model.RewardModelScorer(folder)`
loads it and scores (prompt, completion) texts with the very tokenization used
in training.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from tandem.models.attention import CausalAttention
from tandem.models.lora import lora_spec_of
from tandem.models.value_head import ScalarHeadModel, last_token_scores, save_scalar_model
from tandem.parallel.cp import ContextParallel
from tandem.parallel.distributed import DistInfo
from tandem.rl.algorithms.preference import bradley_terry_loss
from tandem.rl.core.lora import merged_state
from tandem.rl.core.modeling import BuildSpec, build_scalar_model, gather_full_state
from tandem.rl.data.preference import PreferencePair, collate_pairs
from tandem.rl.recipes.base import Runtime
from tandem.rl.recipes.pairwise import PairSetup, PairwiseRecipe, pair_accuracy
from tandem.rl.update.cp_batch import RowShare

__all__ = ["EXPORT_DIR", "RewardModelHead", "make_reward_model", "pair_scores"]

EXPORT_DIR = "reward_model"  # under job.dump_folder


def pair_scores(
    model: ScalarHeadModel, batch: dict[str, Tensor], cp: ContextParallel | None = None
) -> Tensor:
    """Score of each row at its last real token: ``[2B]`` (chosen rows, then rejected). ``cp``:
    each rank runs its share of the rows; a score comes from the rank holding its token."""
    if cp is None:
        return last_token_scores(model(batch["tokens"]), batch["lengths"])  # [2B]
    tokens = batch["tokens"]  # [2B, S]
    share = RowShare(cp, torch.zeros_like(tokens), lambda _: CausalAttention())
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    local = model(share.take(tokens, 0), positions=share.take(positions, 0), attn=share.attn)
    share.check_calls(model)
    last = (batch["lengths"].to(tokens.device).long() - 1).clamp(min=0)  # [2B]
    return share.at_columns(local, last)  # [2B]


class RewardModelHead:
    """A trunk with a scalar head, trained with the Bradley-Terry loss on each pair's two scores."""

    def __init__(self, cfg: Any, info: DistInfo, setup: PairSetup, spec: BuildSpec) -> None:
        self.info, self.setup = info, setup
        self.model = build_scalar_model(
            setup.args,
            cfg.model.path,
            cfg.job.seed,
            setup.mesh,
            info.device,
            spec,
            is_main=info.is_main,
        )

    def micro(self, pairs: list[PreferencePair], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        batch = {
            k: v.to(self.info.device) for k, v in collate_pairs(pairs, self.setup.pad_id).items()
        }
        scores = pair_scores(self.model, batch, self.setup.cp)
        c, r = scores[: len(pairs)], scores[len(pairs) :]
        loss = bradley_terry_loss(c, r)  # [B]
        c, r = c.detach(), r.detach()
        return loss, {
            "loss": loss.detach(),
            "accuracy": pair_accuracy(c, r),
            "margin": c - r,
            "chosen_score": c,
            "rejected_score": r,
        }

    def export(self, dump_folder: str) -> str:
        out = os.path.join(dump_folder, EXPORT_DIR)
        state = merged_state(gather_full_state(self.model), lora_spec_of(self.model))
        if self.info.is_main:
            save_scalar_model(state, self.setup.args, out, tokenizer=self.setup.tokenizer)
        return out


def make_reward_model(cfg: Any, rt: Runtime) -> PairwiseRecipe:
    return PairwiseRecipe(cfg, rt, "reward_model", RewardModelHead)
