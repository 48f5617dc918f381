"""The ``sft`` recipe: supervised fine-tuning on packed chat data, FSDP2.

The loss is the token-mean cross-entropy over the assistant tokens of the
whole optimizer step (all micro-batches, all data-parallel ranks), so the
update does not depend on how the batch is split across ranks or micro-batches.
Under ``parallel.cp`` the cp ranks of a data-parallel rank take the same rows and
each runs its share of every row (tandem/rl/update/cp_batch.py `RowShare`): the
cross-entropy of its own tokens, summed over all ranks like the data-parallel shares.
With ``data.eval_fraction > 0`` a seeded share of the examples is held out and
``eval/loss`` is their token-mean cross-entropy.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.models.attention import DocumentAttention
from tandem.models.vlm import vision_batch
from tandem.rl.core.modeling import BuildSpec, build_transformer, export_hf
from tandem.rl.data.images import VisionData
from tandem.rl.data.sft import (
    IGNORE,
    PackedRow,
    StepSampler,
    build_sft_data,
    collate,
    load_sft_records,
)
from tandem.rl.recipes.base import (
    Runtime,
    SingleModelRecipe,
    SingleModelTraining,
    StepOutput,
    setup,
)
from tandem.rl.recipes.pairwise import rank_indices, reshard_all
from tandem.rl.update.cp_batch import RowShare
from tandem.rl.update.policy import cp_metrics


def split_held_out(records: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held-out): a seeded ``fraction`` of the records held out, both in file order."""
    n_eval = int(len(records) * fraction)
    if n_eval == 0:
        return records, []
    g = torch.Generator().manual_seed(seed * 7_919 + 1)
    held = set(torch.randperm(len(records), generator=g)[:n_eval].tolist())
    return (
        [r for i, r in enumerate(records) if i not in held],
        [r for i, r in enumerate(records) if i in held],
    )


class SFTRecipe(SingleModelRecipe):
    console_keys = ("loss", "grad_norm", "lr", "throughput/tokens_per_s", "epoch", "eval/loss")

    def __init__(self, cfg: Any, rt: Runtime) -> None:
        self.cfg, self.info = cfg, rt.info
        info = rt.info
        s = setup(cfg, rt, "sft", batch=("training.batch_size", cfg.training.batch_size))
        self.mesh, self.dp, self.rank_dp = s.mesh, s.dp, s.rank_dp
        self.tokenizer, self.args = s.tokenizer, s.args
        self.cp = s.row_split(cfg.parallel)  # None: cp = 1
        self.cp_size = self.cp.size if self.cp is not None else 1
        d = cfg.data
        records = load_sft_records(
            d.path, d.format, seed=cfg.job.seed, n_synthetic=d.synthetic_rows
        )
        train, held = split_held_out(records, d.eval_fraction, cfg.job.seed)
        self.vision = VisionData.for_model(self.args, d.path)
        kw = dict(
            tokenizer=self.tokenizer,
            source=d.path,
            max_length=d.max_length,
            pack=d.pack,
            on_bad_row=d.on_bad_row,
            messages_field=d.messages_field,
            prompt_field=d.prompt_field,
            completion_field=d.completion_field,
            vision=self.vision,
        )
        self.data = build_sft_data(train, **kw)
        self.eval_rows: list[PackedRow] = build_sft_data(held, **kw).rows if held else []
        if info.is_main:
            skipped = sum(self.data.skipped.values())
            held_out = f" (+{len(self.eval_rows)} held-out rows)" if self.eval_rows else ""
            print(
                f"data: {self.data.num_examples} examples -> {len(self.data.rows)} "
                f"rows{held_out}; skipped {skipped} {dict(self.data.skipped)}",
                flush=True,
            )
        lora = cfg.lora.setup(cfg.job.seed, base_model=cfg.model.path)
        spec = BuildSpec.from_config(cfg.training, cfg.parallel, cfg.model, lora)
        self.model = build_transformer(
            self.args,
            cfg.model.path,
            cfg.job.seed,
            self.mesh,
            info.device,
            spec,
            is_main=info.is_main,
        )
        self.training = SingleModelTraining(self.model, cfg, rt.dump_folder, rt.info.rank)
        self.updater = self.training.updater
        self.sampler = StepSampler(
            len(self.data.rows), cfg.training.batch_size, cfg.job.seed, d.shuffle
        )
        self.pad_id = s.pad_id

    def _token_losses(self, rows: list[PackedRow], per_row: bool = False) -> torch.Tensor:
        """Summed cross-entropy of the trained tokens (with grad): a scalar, or ``[B]`` per row."""
        dev = self.info.device
        batch = {k: v.to(dev) for k, v in collate(rows, self.pad_id).items()}
        share = RowShare(self.cp, batch["doc_ids"], DocumentAttention)  # cp = 1: the row itself
        inputs = self._inputs(rows, batch)
        inputs["positions"] = share.take(inputs["positions"], 0)
        logits = self.model(share.take(batch["tokens"], self.pad_id), attn=share.attn, **inputs)
        share.check_calls(self.model)
        tok = F.cross_entropy(
            logits.flatten(0, 1).float(),
            share.take(batch["targets"], IGNORE).flatten(),
            ignore_index=IGNORE,
            reduction="none" if per_row else "sum",
        )  # this rank's tokens: the cp ranks' sums add up to the rows'
        return tok.view(len(rows), -1).sum(-1) if per_row else tok

    def _inputs(self, rows: list[PackedRow], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Positions (M-RoPE ``[3, B, S]`` for a vision-language policy) and the images' inputs;
        each example's pixels are prepared here and dropped again (they are not kept per row)."""
        if self.vision is None:
            return {"positions": batch["positions"]}
        docs = {
            (b, d): im
            for b, r in enumerate(rows)
            for d, im in enumerate(r.images)
            if im is not None
        }
        positions, images = vision_batch(
            batch["tokens"], batch["positions"], batch["doc_ids"], docs, self.vision.image_token_id
        )
        for im in docs.values():
            im.release()
        return {
            "positions": positions,
            "images": images.to(self.info.device) if images is not None else None,
        }

    def step(self, step: int) -> StepOutput:
        t0 = time.monotonic()
        local = self.sampler.local_batch(step, self.rank_dp, self.dp)
        rows = [self.data.rows[i] for i in local]
        counts = torch.tensor(
            [sum(r.num_targets for r in rows), sum(len(r.tokens) for r in rows)],
            dtype=torch.float64,
        )
        dist.all_reduce(counts)  # global trained tokens and tokens this step
        counts /= self.cp_size  # the cp ranks of a data-parallel rank hold the same rows
        global_targets = max(counts[0].item(), 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.info.device)
        self.model.train()
        micro = self.cfg.training.micro_batch_size
        for m0 in range(0, len(rows), micro):
            tok_loss = self._token_losses(rows[m0 : m0 + micro])
            # FSDP averages gradients over the dp x cp ranks: scale so the result is the global
            # token mean.
            (tok_loss * (self.dp * self.cp_size / global_targets)).backward()
            loss_sum += tok_loss.detach().double()
        grad_norm = self.updater.apply(loss_sum, step).get("model")
        dist.all_reduce(loss_sum)
        dt = time.monotonic() - t0
        return StepOutput(
            {
                **cp_metrics(self.cp, self.info.device, None),
                "loss": loss_sum.item() / global_targets,
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                "throughput/tokens_per_s": counts[1].item() / dt,
                "data/trained_tokens": counts[0].item(),
                "epoch": self.sampler.epoch_of(step),
                "data/skipped_rows": sum(self.data.skipped.values()),
            },
            [f"row-{i}" for i in local],
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.eval_rows:
            return {}
        idx, valid = rank_indices(len(self.eval_rows), self.rank_dp, self.dp)
        sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)  # loss, trained tokens
        self.model.eval()
        micro = self.cfg.training.micro_batch_size
        for m0 in range(0, len(idx), micro):
            rows = [self.eval_rows[i] for i in idx[m0 : m0 + micro]]
            w = torch.tensor(valid[m0 : m0 + micro], dtype=torch.float64, device=self.info.device)
            sums[0] += (self._token_losses(rows, per_row=True).double() * w).sum()
            sums[1] += (
                torch.tensor([r.num_targets for r in rows], dtype=torch.float64, device=w.device)
                * w
            ).sum()
        reshard_all(self.model)
        self.model.train()
        dist.all_reduce(sums)  # losses: each cp rank's tokens; counts: each cp rank's copy
        return {"eval/loss": sums[0].item() / max(sums[1].item() / self.cp_size, 1.0)}

    def export(self, dump_folder: str) -> str:
        out = os.path.join(dump_folder, "hf")
        export_hf(self.model, self.args, self.tokenizer, out, self.info.rank)
        return out

    def close(self) -> None:
        pass


def make_sft(cfg: Any, rt: Runtime) -> SFTRecipe:
    return SFTRecipe(cfg, rt)


__all__ = ["SFTRecipe", "make_sft", "split_held_out"]
