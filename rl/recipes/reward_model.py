"""Bradley-Terry reward-model trainer, and `RewardModelScorer` to use the result as a reward.

The model is `models.value_head.ScalarHeadModel`: a transformer trunk (from a
policy HF folder, a reward-model folder, or a from-scratch flavor) with a
scalar head. A pair's score is the head's output at the last real token of
each side (context + reply through the chat template, as rl/data/preference.py
renders it), and the loss is -log sigmoid(s_chosen - s_rejected)
(rl/algorithms/preference.py `bradley_terry_loss`), averaged over the step's
pairs with the layout-invariant scaling of the shared pairwise loop
(rl/recipes/dpo.py `run_pair_loop`).

At the end the model is written to ``<dump_folder>/reward_model`` (config.json,
safetensors, tokenizer); `RewardModelScorer(folder)` loads it and scores
(prompt, completion) texts with the very tokenization used in training.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from models.tokenizer import Tokenizer
from models.value_head import (
    ScalarHeadModel,
    initial_scalar_state,
    last_token_scores,
    load_scalar_model,
    save_scalar_model,
)
from parallel.ac import apply_ac
from parallel.compile import apply_compile
from parallel.distributed import DistInfo
from parallel.fsdp import apply_fsdp
from parallel.mesh import dp_mesh
from rl.algorithms.preference import bradley_terry_loss
from rl.data.preference import PreferencePair, collate_pairs, tokenize_response
from rl.recipes.dpo import pair_accuracy, run_pair_loop, setup_pairs
from rl.runtime.modeling import ModelSetupError, gather_full_state, load_full_state

__all__ = ["EXPORT_DIR", "RewardModelScorer", "build_sharded_scalar_model", "run_reward_model"]

EXPORT_DIR = "reward_model"  # under job.dump_folder


def build_sharded_scalar_model(args: Any, mesh: Any, device: torch.device, *, path: str | None, seed: int,
                               param_dtype: str, reduce_dtype: str, cpu_offload: bool,
                               is_main: bool, activation_checkpoint: str = "none",
                               compile: bool = False) -> ScalarHeadModel:
    """Meta-init, activation checkpointing, compile, FSDP2 over the data-parallel mesh, then
    rank 0's full weights broadcast in (the order rl/runtime/modeling.py uses for the policy)."""
    with torch.device("meta"):
        model = ScalarHeadModel(args)
    apply_ac(model, activation_checkpoint)  # these find the blocks through ScalarHeadModel.layers
    if compile:
        apply_compile(model)
    on_gpu = device.type != "cpu"
    apply_fsdp(model, dp_mesh(mesh), param_dtype=param_dtype if on_gpu else "float32",
               reduce_dtype=reduce_dtype if on_gpu else "float32", cpu_offload=cpu_offload)
    model.to_empty(device=device)
    model.reset_rope()
    full = None
    if is_main:
        try:
            full = initial_scalar_state(args, path, seed)
        except (OSError, ValueError, KeyError) as e:
            raise ModelSetupError(f"model.path: {str(e).strip().splitlines()[0]}") from None
    load_full_state(model, full)
    return model


def pair_scores(model: ScalarHeadModel, batch: dict[str, Tensor]) -> Tensor:
    """Score of each row at its last real token: ``[2B]`` (chosen rows, then rejected)."""
    return last_token_scores(model(batch["tokens"]), batch["lengths"])  # [2B]


def run_reward_model(cfg: Any, info: DistInfo) -> int:
    """The ``reward_model`` recipe."""
    setup = setup_pairs(cfg, info, "reward_model")
    model = build_sharded_scalar_model(
        setup.args, setup.mesh, info.device, path=cfg.model.path, seed=cfg.job.seed,
        param_dtype=cfg.training.mixed_precision_param, reduce_dtype=cfg.training.mixed_precision_reduce,
        cpu_offload=cfg.parallel.cpu_offload, is_main=info.is_main,
        activation_checkpoint=cfg.parallel.activation_checkpoint, compile=cfg.parallel.compile)

    def micro_fn(pairs: list[PreferencePair], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        batch = {k: v.to(info.device) for k, v in collate_pairs(pairs, setup.pad_id).items()}
        scores = pair_scores(model, batch)
        c, r = scores[: len(pairs)], scores[len(pairs):]
        loss = bradley_terry_loss(c, r)  # [B]
        c, r = c.detach(), r.detach()
        return loss, {"loss": loss.detach(), "accuracy": pair_accuracy(c, r), "margin": c - r,
                      "chosen_score": c, "rejected_score": r}

    def export() -> str:
        out = os.path.join(cfg.job.dump_folder, EXPORT_DIR)
        state = gather_full_state(model)
        if info.is_main:
            save_scalar_model(state, setup.args, out, tokenizer=setup.tokenizer)
        return out

    return run_pair_loop(cfg, info, setup, model, micro_fn, export=export,
                         console_keys=("loss", "accuracy", "margin", "eval_accuracy", "grad_norm", "lr"))


Context = str | list[dict[str, Any]]


class RewardModelScorer:
    """Scores (prompt, completion) texts with a reward-model folder, on one device, no sharding.

    A prompt is a string (one user turn) or a message list; a completion is the
    assistant reply text. Both go through `tokenize_response`, the function the
    trainer's data used, so a pair scored here gets the trainer's numbers.
    """

    def __init__(self, folder: str, device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32,
                 batch_size: int = 16) -> None:
        self.tokenizer = Tokenizer.from_dir(folder)
        self.model = load_scalar_model(folder, device, dtype).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.pad_id = self.tokenizer.pad_token_id or 0

    @torch.no_grad()
    def score(self, prompts: Sequence[Context], completions: Sequence[str]) -> list[float]:
        """One scalar per (prompt, completion), in order. Batches are formed by length so
        little padding is computed; right padding never changes a score (causal attention)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        seqs = [tokenize_response(p, c, self.tokenizer).input_ids for p, c in zip(prompts, completions)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = [0.0] * len(seqs)
        for b0 in range(0, len(order), self.batch_size):
            idx = order[b0:b0 + self.batch_size]
            s = max(len(seqs[i]) for i in idx)
            tokens = torch.full((len(idx), s), self.pad_id, dtype=torch.long)
            for row, i in enumerate(idx):
                tokens[row, : len(seqs[i])] = torch.tensor(seqs[i])
            lengths = torch.tensor([len(seqs[i]) for i in idx])
            scores = last_token_scores(self.model(tokens.to(self.device)), lengths)  # [b]
            for i, v in zip(idx, scores.tolist()):
                out[i] = v
        return out
