"""The pairwise recipe shared by DPO-style losses (tandem/rl/recipes/dpo.py) and reward models
(tandem/rl/recipes/reward_model.py): the data, the step and the held-out evaluation.

A step takes ``training.batch_size`` pairs, split over the data-parallel ranks
and then into micro-batches of ``training.micro_batch_size`` pairs; the chosen
and rejected sides of a pair always sit in the same micro-batch (one forward
of 2B sequences). The loss is the mean over the step's pairs: each rank
backpropagates ``sum(per-pair loss) * dp / batch_size`` because FSDP2 averages
gradients over the dp ranks, so the update does not depend on the layout.
Under ``parallel.cp`` the cp ranks of a data-parallel rank take the same pairs and
each runs its share of every sequence (tandem/rl/update/cp_batch.py `RowShare`):
sequence log-probs and scores are summed over cp before the loss, so every cp rank
computes the same loss and backpropagates its own tokens' part (scaled by dp x cp).

What differs between the two recipes is a `PairHead`: the model it trains,
the per-pair loss and metrics of a micro-batch, and the export. Accuracy
counts a tie as half a win, so an untrained model reads 0.5, chance, not 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from tandem.models.attention import CausalAttention
from tandem.models.vlm import vision_batch
from tandem.parallel.cp import ContextParallel
from tandem.parallel.distributed import DistInfo
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.data.images import VisionData
from tandem.rl.data.preference import (
    PreferenceData,
    PreferencePair,
    collate_pairs,
    load_preference_data,
)
from tandem.rl.data.sft import StepSampler
from tandem.rl.recipes.base import (
    Runtime,
    Setup,
    SingleModelRecipe,
    SingleModelTraining,
    StepOutput,
    setup,
)
from tandem.rl.update.cp_batch import RowShare
from tandem.rl.update.policy import cp_metrics

__all__ = [
    "PairHead",
    "PairSetup",
    "PairwiseRecipe",
    "pair_accuracy",
    "pair_images",
    "precompute_reference",
    "rank_indices",
    "reshard_all",
    "sequence_logps",
    "setup_pairs",
]


# ---------------------------------------------------------------------- tensor pieces
def sequence_logps(
    model: nn.Module,
    batch: dict[str, Tensor],
    images: list[Any] | None = None,
    cp: ContextParallel | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed log-probs of each row's response tokens and their count: ``[N]``, ``[N]``.

    ``batch`` is `collate_pairs` output; token t's logits predict token t+1, so
    the response mask is read shifted by one. Log-probs are taken in fp32.
    ``images``: per row, its `PromptImages` or None (a vision-language policy).
    ``cp``: each rank runs its share of the rows and the sums are the whole rows'.
    """
    tokens, mask = batch["tokens"], batch["loss_mask"][:, 1:].bool()  # [N, S], [N, S-1]
    x = tokens[:, :-1]  # [N, S-1]
    share = RowShare(cp, torch.zeros_like(x), lambda _: CausalAttention())
    inputs = _image_inputs(model, x, images)  # {} but for a vision-language policy
    if share.split is not None:  # explicit positions: each rank's share of them
        inputs["positions"] = share.take(torch.arange(x.shape[1], device=x.device).expand_as(x), 0)
    logits = model(share.take(x, 0), attn=share.attn, **inputs)  # [N, S'/cp, V]
    share.check_calls(model)
    targets = share.take(tokens[:, 1:], 0)  # [N, S'/cp]
    tok_logp = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    tok_logp = torch.where(share.take(mask, 0), tok_logp.view_as(targets), 0.0)  # [N, S'/cp]
    return share.row_sums(tok_logp.sum(-1)), mask.sum(-1)


def _image_inputs(model: nn.Module, tokens: Tensor, images: list[Any] | None) -> dict[str, Any]:
    """A vision-language policy's M-RoPE positions and image rows for right-padded rows."""
    vision = getattr(getattr(model, "args", None), "vision", None)
    if vision is None:
        return {}
    n, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).expand(n, s)
    docs = {(row, 0): im for row, im in enumerate(images or []) if im is not None}
    positions, inputs = vision_batch(
        tokens, positions, torch.zeros_like(tokens), docs, vision.image_token_id
    )
    for im in docs.values():
        im.release()
    return {"positions": positions, "images": None if inputs is None else inputs.to(tokens.device)}


def pair_images(pairs: list[PreferencePair]) -> list[Any]:
    """The rows' images in `collate_pairs` order: the B chosen, then the B rejected."""
    return [p.chosen.images for p in pairs] + [p.rejected.images for p in pairs]


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit after forwards without backward (reference, eval).

    tandem/parallel/fsdp.py keeps the last block unsharded after forward (backward
    needs it at once); with no backward to reshard it, the module would keep
    its unsharded tensors registered, so an optimizer built next would hold
    them instead of the sharded parameters, and a forward after an optimizer
    step would read stale weights. Found by the precompute == online test.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """1 where chosen wins, 0.5 on a tie, 0 where it loses: ``[B]``."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def rank_indices(n: int, rank: int, dp: int) -> tuple[list[int], list[bool]]:
    """This rank's share of ``n`` items (rank, rank+dp, ...), padded to ceil(n/dp) so every
    rank runs the same number of (collective) FSDP forwards; padding repeats item 0,
    flagged False."""
    per_rank = -(-n // dp)
    idx = [rank + k * dp for k in range(per_rank)]
    return [i if i < n else 0 for i in idx], [i < n for i in idx]


@torch.no_grad()
def precompute_reference(
    model: nn.Module,
    pairs: list[PreferencePair],
    *,
    micro: int,
    pad_id: int,
    device: torch.device,
    rank: int,
    dp: int,
    cp: ContextParallel | None = None,
) -> Tensor:
    """Reference log-probs of every pair with ``model`` as it is now: ``[N, 2]`` (chosen, rejected),
    the same table on every rank (each data-parallel rank scores its share, split over its cp
    ranks, then an all-gather)."""
    if not pairs:
        return torch.zeros((0, 2), device=device)
    was_training = model.training
    model.eval()
    idx, _ = rank_indices(len(pairs), rank, dp)
    parts = []
    for m0 in range(0, len(idx), micro):
        sub = [pairs[i] for i in idx[m0 : m0 + micro]]
        logps, _ = sequence_logps(
            model,
            {k: v.to(device) for k, v in collate_pairs(sub, pad_id).items()},
            pair_images(sub),
            cp,
        )
        parts.append(torch.stack(logps.float().chunk(2), dim=1))  # [b, 2]
    local = torch.cat(parts)  # [per_rank, 2]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    reshard_all(model)
    model.train(was_training)
    # world rank dp_rank x cp + cp_rank (tp = pp = 1 outside rl): one copy per data-parallel
    # rank; row k of data-parallel rank r is item k*dp + r
    per_dp = gathered[:: cp.size if cp is not None else 1]
    return torch.stack(per_dp, dim=1).reshape(-1, 2)[: len(pairs)]


# ---------------------------------------------------------------------- data
@dataclass
class PairSetup(Setup):
    """The recipes' shared `Setup` and the preference pairs."""

    data: PreferenceData
    cp: ContextParallel | None  # the cp group rows are split over (None: cp = 1)


def setup_pairs(cfg: Any, rt: Runtime, recipe: str) -> PairSetup:
    """Mesh, tokenizer, model args and preference pairs for a pairwise recipe."""
    base = setup(cfg, rt, recipe, batch=("training.batch_size", cfg.training.batch_size))
    torch.manual_seed(cfg.job.seed + rt.info.rank)
    d, p = cfg.data, cfg.preference
    data = load_preference_data(
        d.path,
        base.tokenizer,
        fmt=d.format,
        max_length=d.max_length,
        on_bad_row=d.on_bad_row,
        eval_fraction=d.eval_fraction,
        eval_source=d.eval_path,
        seed=cfg.job.seed,
        synthetic_rows=d.synthetic_rows,
        messages_field=d.messages_field,
        prompt_field=d.prompt_field,
        chosen_field=p.chosen_field,
        rejected_field=p.rejected_field,
        vision=VisionData.for_model(base.args, d.path),
    )
    if rt.info.is_main:
        print(
            f"data: {len(data.train)} train pairs, {len(data.eval)} held-out; skipped "
            f"{sum(data.skipped.values())} {dict(data.skipped)}",
            flush=True,
        )
    return PairSetup(
        **{f.name: getattr(base, f.name) for f in fields(Setup)},
        data=data,
        cp=base.row_split(cfg.parallel),
    )


# ---------------------------------------------------------------------- the recipe
class PairHead(Protocol):
    """What a pairwise recipe trains: ``model``, ``micro(pairs, split)`` -> (per-pair loss
    ``[B]`` with grad, per-pair metrics ``[B]`` each; split is "train" or "eval"), ``export``."""

    model: nn.Module

    def micro(
        self, pairs: list[PreferencePair], split: str
    ) -> tuple[Tensor, dict[str, Tensor]]: ...

    def export(self, dump_folder: str) -> str: ...


HeadFactory = Callable[[Any, DistInfo, "PairSetup", BuildSpec], PairHead]


class PairwiseRecipe(SingleModelRecipe):
    console_keys = ("loss", "accuracy", "margin", "eval/accuracy", "grad_norm", "lr")

    def __init__(self, cfg: Any, rt: Runtime, name: str, make_head: HeadFactory) -> None:
        self.cfg, self.info = cfg, rt.info
        self.setup = setup_pairs(cfg, rt, name)
        lora = cfg.lora.setup(cfg.job.seed, base_model=cfg.model.path)
        spec = BuildSpec.from_config(cfg.training, cfg.parallel, cfg.model, lora)
        self.head = make_head(cfg, rt.info, self.setup, spec)
        self.model = self.head.model
        self.training = SingleModelTraining(self.model, cfg, rt.dump_folder, rt.info.rank)
        self.updater = self.training.updater
        self.sampler = StepSampler(
            len(self.setup.data.train), cfg.training.batch_size, cfg.job.seed, cfg.data.shuffle
        )
        self.model.train()

    def step(self, step: int) -> StepOutput:
        t0 = time.monotonic()
        s, dev = self.setup, self.info.device
        micro, batch = self.cfg.training.micro_batch_size, self.cfg.training.batch_size
        cp = s.cp.size if s.cp is not None else 1
        local = self.sampler.local_batch(step, s.rank_dp, s.dp)
        pairs = [s.data.train[i] for i in local]
        sums: dict[str, Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for m0 in range(0, len(pairs), micro):
            loss, metrics = self.head.micro(pairs[m0 : m0 + micro], "train")
            # FSDP averages gradients over the dp x cp ranks: this makes the result the mean over
            # the global batch.
            (loss.sum() * (s.dp * cp / batch)).backward()
            loss_sum += loss.detach().double().sum()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.double().sum()
        grad_norm = self.updater.apply(loss_sum, step).get("model")
        names = list(sums)
        tokens = sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs)
        total = torch.stack(
            [sums[k] for k in names]
            + [torch.tensor(float(tokens), dtype=torch.float64, device=dev)]
        )
        dist.all_reduce(total)  # one host sync per step, for the metrics row
        values = (total / cp).tolist()  # the cp ranks of a data-parallel rank: the same pairs
        dt = time.monotonic() - t0
        row = {k: v / batch for k, v in zip(names, values)}
        row.update(
            {
                **cp_metrics(s.cp, dev, None),
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                "throughput/pairs_per_s": batch / dt,
                "throughput/tokens_per_s": values[-1] / dt,
                "epoch": self.sampler.epoch_of(step),
                "data/skipped_rows": sum(s.data.skipped.values()),
            }
        )
        return StepOutput(row, [f"pair-{i}" for i in local])

    def evaluate(self) -> dict[str, float]:
        return _evaluate(
            self.model,
            self.head.micro,
            self.setup,
            self.cfg.training.micro_batch_size,
            self.info.device,
        )

    def export(self, dump_folder: str) -> str:
        return self.head.export(dump_folder)

    def close(self) -> None:
        pass


def _evaluate(
    model: nn.Module,
    micro_fn: Callable[[list[PreferencePair], str], tuple[Tensor, dict[str, Tensor]]],
    setup: PairSetup,
    micro: int,
    device: torch.device,
) -> dict[str, float]:
    """Mean of every per-pair metric over the held-out pairs ("eval/" + name)."""
    pairs = setup.data.eval
    if not pairs:
        return {}
    idx, valid = rank_indices(len(pairs), setup.rank_dp, setup.dp)
    sums: dict[str, Tensor] = {}
    model.eval()
    with torch.no_grad():
        for m0 in range(0, len(idx), micro):
            w = torch.tensor(valid[m0 : m0 + micro], dtype=torch.float64, device=device)  # [b]
            _, metrics = micro_fn([pairs[i] for i in idx[m0 : m0 + micro]], "eval")
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v.double() * w).sum()
    reshard_all(model)
    model.train()
    names = list(sums)
    total = torch.stack([sums[k] for k in names])
    dist.all_reduce(total)
    total /= setup.cp.size if setup.cp is not None else 1  # each cp rank's copy of its pairs
    return {f"eval/{k}": v / len(pairs) for k, v in zip(names, total.tolist())}
