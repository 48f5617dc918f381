"""The ``dpo`` recipe: offline preference learning (DPO, IPO, SimPO, ...) on the pairwise recipe.

Sequence log-probs are SUMMED over response tokens (the lengths go along for
length-normalised losses); the loss itself is a registry entry
(tandem/rl/algorithms/preference.py, chosen by ``preference.loss``), never a branch here.

Reference log-probs (``preference.reference``):
- "precompute": one pass over every train and held-out pair with the policy
  before its first update (it *is* the reference then); the [N, 2] table is
  kept and no second model is held. On resume the pass runs again before the
  checkpoint is loaded (the shell loads it after the recipe is built), so it
  still sees the initial weights.
- "online": a frozen copy of the initial policy, sharded like it, scores each
  micro-batch.
- "none": for losses that do not use a reference (SimPO). Whether a loss needs
  one is its registered ``needs_reference`` capability.

With LoRA (``[lora]``) the reference is the policy's frozen base with its adapters
off (tandem/models/lora.py `adapters_disabled`): "online" scores with the policy
itself and no copy is built; "precompute" scores with the adapters off, so a run that
starts from an existing adapter (``lora.adapter_path``) still measures against the base.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import Tensor

from tandem.models.lora import adapters_disabled, has_lora
from tandem.parallel.distributed import DistInfo
from tandem.rl.algorithms.preference import PREFERENCE_LOSSES, PreferenceInput
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.modeling import BuildSpec, build_transformer, export_hf
from tandem.rl.data.preference import PreferencePair, collate_pairs
from tandem.rl.recipes.base import Runtime
from tandem.rl.recipes.pairwise import (
    PairSetup,
    PairwiseRecipe,
    pair_accuracy,
    pair_images,
    precompute_reference,
    reshard_all,
    sequence_logps,
)


class DPOHead:
    """The policy, its reference (a frozen copy or a precomputed table) and the registered loss."""

    def __init__(self, cfg: Any, info: DistInfo, setup: PairSetup, spec: BuildSpec) -> None:
        pcfg = cfg.preference
        self.info, self.setup = info, setup
        self.loss_fn, self.loss_cfg = PREFERENCE_LOSSES.get(pcfg.loss), pcfg
        reference = pcfg.reference
        if PREFERENCE_LOSSES.cap(pcfg.loss, "needs_reference", True):
            if reference == "none":
                raise ConfigError(
                    f"preference.reference: loss {pcfg.loss!r} needs reference "
                    "log-probs; set 'precompute' or 'online'"
                )
        elif reference != "none":
            if info.is_main:
                print(
                    f"note: loss {pcfg.loss!r} does not use a reference; preference.reference="
                    f"{reference!r} ignored",
                    flush=True,
                )
            reference = "none"
        build = dict(mesh=setup.mesh, device=info.device, spec=spec, is_main=info.is_main)
        self.model = build_transformer(setup.args, cfg.model.path, cfg.job.seed, **build)
        self.ref_model = None
        # the policy, adapters off
        self.base_reference = reference == "online" and has_lora(self.model)
        self.table: dict[str, Tensor] = {}
        if reference == "online" and not self.base_reference:
            self.ref_model = build_transformer(
                setup.args, cfg.model.path, cfg.job.seed, trainable=False, **build
            )
        elif reference == "precompute":
            # before any checkpoint is loaded: the policy is the reference now
            t0 = time.monotonic()
            kw = dict(
                micro=cfg.training.micro_batch_size,
                pad_id=setup.pad_id,
                device=info.device,
                rank=setup.rank_dp,
                dp=setup.dp,
                cp=setup.cp,
            )
            with adapters_disabled(self.model):  # LoRA: the base (a no-op without adapters)
                self.table = {
                    "train": precompute_reference(self.model, setup.data.train, **kw),
                    "eval": precompute_reference(self.model, setup.data.eval, **kw),
                }
            if info.is_main:
                n = len(setup.data.train) + len(setup.data.eval)
                print(
                    f"reference log-probs of {n} pairs precomputed in {time.monotonic() - t0:.1f}s",
                    flush=True,
                )

    def micro(self, pairs: list[PreferencePair], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        dev = self.info.device
        batch = {k: v.to(dev) for k, v in collate_pairs(pairs, self.setup.pad_id).items()}
        b = len(pairs)
        images = pair_images(pairs)
        # [2B] each: chosen then rejected
        logps, lengths = sequence_logps(self.model, batch, images, self.setup.cp)
        ref_c = ref_r = None
        if self.ref_model is not None or self.base_reference:
            ref_model = self.ref_model if self.ref_model is not None else self.model
            with torch.no_grad(), adapters_disabled(ref_model):
                ref, _ = sequence_logps(ref_model, batch, images, self.setup.cp)
            reshard_all(ref_model)  # frees its last block's unsharded copy (no backward will)
            ref_c, ref_r = ref[:b], ref[b:]
        elif self.table:
            rows = self.table[split][torch.tensor([p.index for p in pairs], device=dev)]  # [B, 2]
            ref_c, ref_r = rows[:, 0], rows[:, 1]
        out = self.loss_fn(
            PreferenceInput(logps[:b], logps[b:], ref_c, ref_r, lengths[:b], lengths[b:]),
            self.loss_cfg,
        )
        c, r = out.chosen_rewards, out.rejected_rewards
        return out.loss, {
            "loss": out.loss.detach(),
            "accuracy": pair_accuracy(c, r),
            "margin": c - r,
            "chosen_reward": c,
            "rejected_reward": r,
            "chosen_logp": logps[:b].detach(),
            "rejected_logp": logps[b:].detach(),
        }

    def export(self, dump_folder: str) -> str:
        out = os.path.join(dump_folder, "hf")
        export_hf(self.model, self.setup.args, self.setup.tokenizer, out, self.info.rank)
        return out


def make_dpo(cfg: Any, rt: Runtime) -> PairwiseRecipe:
    return PairwiseRecipe(cfg, rt, "dpo", DPOHead)
