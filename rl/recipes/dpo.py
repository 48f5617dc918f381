"""Offline preference trainer (DPO, IPO, SimPO, ...) and the pairwise loop it shares with reward models.

A step takes ``training.batch_size`` pairs, split over the data-parallel ranks
and then into micro-batches of ``training.micro_batch_size`` pairs; the chosen
and rejected sides of a pair always sit in the same micro-batch (one forward
of 2B sequences). The loss is the mean over the step's pairs: each rank
backpropagates ``sum(per-pair loss) * dp / batch_size`` because FSDP2 averages
gradients over the dp ranks, so the update does not depend on the layout.

Sequence log-probs are SUMMED over response tokens (the lengths go along for
length-normalised losses); the loss itself is a registry entry
(rl/algorithms/preference.py, chosen by ``preference.loss``), never a branch here.

Reference log-probs (``preference.reference``):
- "precompute": one pass over every train and held-out pair with the policy
  before its first update (it *is* the reference then); the [N, 2] table is
  kept and no second model is held. On resume the pass runs again before the
  checkpoint is loaded, so it still sees the initial weights.
- "online": a frozen copy of the initial policy, sharded like it, scores each
  micro-batch.
- "none": for losses that do not use a reference (SimPO). A loss that needs one
  is found by calling it without (it raises), not by its name.

Accuracy counts a tie as half a win, so an untrained DPO policy (all implicit
rewards 0) reads 0.5, chance, not 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from models.args import ModelArgs
from models.tokenizer import Tokenizer
from parallel.distributed import DistInfo
from parallel.grad import clip_grad_norm
from parallel.mesh import Degrees, build_mesh, dp_rank
from rl.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceFn,
    PreferenceInput,
)
from rl.data.preference import PreferenceData, PreferencePair, collate_pairs, load_preference_data
from rl.data.sft import StepSampler
from rl.runtime.checkpoint import Checkpointer, resume_note, resume_step
from rl.runtime.config import ConfigError
from rl.runtime.metrics import MetricsLogger
from rl.runtime.modeling import build_sharded_model, build_tokenizer, export_hf, model_args
from rl.runtime.optim import build_optimizer, build_scheduler
from rl.runtime.system import peak_memory_gb

__all__ = [
    "MicroFn",
    "PairSetup",
    "pair_accuracy",
    "precompute_reference",
    "rank_indices",
    "run_pair_loop",
    "reshard_all",
    "run_preference",
    "sequence_logps",
    "setup_pairs",
]

# (micro-batch of pairs, "train" | "eval") -> (per-pair loss [B] with grad, per-pair metrics [B] each)
MicroFn = Callable[[list[PreferencePair], str], tuple[Tensor, dict[str, Tensor]]]


# ---------------------------------------------------------------------- tensor pieces
def sequence_logps(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Summed log-probs of each row's response tokens and their count: ``[N]``, ``[N]``.

    ``batch`` is `collate_pairs` output; token t's logits predict token t+1, so
    the response mask is read shifted by one. Log-probs are taken in fp32.
    """
    tokens, mask = batch["tokens"], batch["loss_mask"][:, 1:].bool()  # [N, S], [N, S-1]
    logits = model(tokens[:, :-1])  # [N, S-1, V]
    targets = tokens[:, 1:]  # [N, S-1]
    tok_logp = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    tok_logp = torch.where(mask, tok_logp.view_as(targets), 0.0)  # [N, S-1]
    return tok_logp.sum(-1), mask.sum(-1)


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit after forwards without backward (reference, eval).

    parallel/fsdp.py keeps the last block unsharded after forward (backward
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
    rank runs the same number of (collective) FSDP forwards; padding repeats item 0, flagged False."""
    per_rank = -(-n // dp)
    idx = [rank + k * dp for k in range(per_rank)]
    return [i if i < n else 0 for i in idx], [i < n for i in idx]


@torch.no_grad()
def precompute_reference(model: nn.Module, pairs: list[PreferencePair], *, micro: int, pad_id: int,
                         device: torch.device, rank: int, dp: int) -> Tensor:
    """Reference log-probs of every pair with ``model`` as it is now: ``[N, 2]`` (chosen, rejected),
    the same table on every rank (each rank scores its share, then an all-gather)."""
    if not pairs:
        return torch.zeros((0, 2), device=device)
    was_training = model.training
    model.eval()
    idx, _ = rank_indices(len(pairs), rank, dp)
    parts = []
    for m0 in range(0, len(idx), micro):
        sub = [pairs[i] for i in idx[m0:m0 + micro]]
        logps, _ = sequence_logps(model, {k: v.to(device) for k, v in collate_pairs(sub, pad_id).items()})
        parts.append(torch.stack(logps.float().chunk(2), dim=1))  # [b, 2]
    local = torch.cat(parts)  # [per_rank, 2]
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local)
    reshard_all(model)
    model.train(was_training)
    # row k of rank r is item k*dp + r
    return torch.stack(gathered, dim=1).reshape(-1, 2)[: len(pairs)]


def _needs_reference(loss_fn: PreferenceFn, loss_cfg: PreferenceConfig) -> bool:
    """Whether a registered loss uses reference log-probs: it raises ValueError without them."""
    z, one = torch.zeros(1), torch.ones(1)
    try:
        loss_fn(PreferenceInput(z, z, None, None, one, one), loss_cfg)
    except ValueError:
        return True
    return False


# ---------------------------------------------------------------------- shared setup and loop
@dataclass
class PairSetup:
    mesh: DeviceMesh
    dp: int
    rank_dp: int
    tokenizer: Tokenizer
    args: ModelArgs
    data: PreferenceData

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0


def setup_pairs(cfg, info: DistInfo, recipe: str) -> PairSetup:
    """Mesh, tokenizer, model args and preference pairs for a pairwise recipe."""
    degrees = Degrees(**cfg.parallel.resolve(info.world_size))
    if degrees.tp > 1 or degrees.pp > 1:
        raise ConfigError(f"parallel.tp / parallel.pp: the {recipe} recipe shards with FSDP2 only so far; set tp = pp = 1")
    if cfg.training.batch_size % degrees.dp:
        raise ConfigError(f"training.batch_size: {cfg.training.batch_size} is not divisible by the "
                          f"{degrees.dp} data-parallel ranks")
    if cfg.data.path is None:
        raise ConfigError(f"data.path: required by the {recipe} recipe (a file or synthetic:<name>)")
    mesh = build_mesh(degrees, info.device)
    torch.manual_seed(cfg.job.seed + info.rank)
    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.path, os.path.join(cfg.job.dump_folder, "tokenizer"))
    args = model_args(cfg.model.flavor, cfg.model.path, tokenizer)
    data = load_preference_data(
        cfg.data.path, tokenizer, fmt=cfg.data.format, max_length=cfg.data.max_length,
        on_bad_row=cfg.data.on_bad_row, eval_fraction=cfg.data.eval_fraction, eval_source=cfg.data.eval_path,
        seed=cfg.job.seed, synthetic_rows=cfg.data.synthetic_rows, messages_field=cfg.data.messages_field,
        prompt_field=cfg.data.prompt_field, chosen_field=cfg.preference.chosen_field,
        rejected_field=cfg.preference.rejected_field,
    )
    if info.is_main:
        print(f"data: {len(data.train)} train pairs, {len(data.eval)} held-out; skipped "
              f"{sum(data.skipped.values())} {dict(data.skipped)}", flush=True)
    return PairSetup(mesh, degrees.dp, dp_rank(mesh), tokenizer, args, data)


def _evaluate(model: nn.Module, micro_fn: MicroFn, setup: PairSetup, micro: int,
              device: torch.device) -> dict[str, float]:
    """Mean of every per-pair metric over the held-out pairs ("eval_" + name)."""
    pairs = setup.data.eval
    if not pairs:
        return {}
    idx, valid = rank_indices(len(pairs), setup.rank_dp, setup.dp)
    sums: dict[str, Tensor] = {}
    model.eval()
    with torch.no_grad():
        for m0 in range(0, len(idx), micro):
            w = torch.tensor(valid[m0:m0 + micro], dtype=torch.float64, device=device)  # [b]
            _, metrics = micro_fn([pairs[i] for i in idx[m0:m0 + micro]], "eval")
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v.double() * w).sum()
    reshard_all(model)
    model.train()
    names = list(sums)
    total = torch.stack([sums[k] for k in names])
    dist.all_reduce(total)
    return {f"eval_{k}": v / len(pairs) for k, v in zip(names, total.tolist())}


def run_pair_loop(cfg, info: DistInfo, setup: PairSetup, model: nn.Module, micro_fn: MicroFn, *,
                  export: Callable[[], str], console_keys: tuple[str, ...]) -> int:
    """Optimizer, resume, the step loop (micro-batches, clip, step, metrics, eval, checkpoints), export.

    ``micro_fn`` gives per-pair losses and metrics; every metric it returns is
    logged as its mean over the step's pairs (and over the held-out pairs at
    evaluation). ``export`` writes the final model (collective) and returns its path.
    """
    dump, steps = cfg.job.dump_folder, cfg.training.steps
    opt = build_optimizer(model, lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                          weight_decay=cfg.optimizer.weight_decay)
    sched = build_scheduler(opt, total_steps=steps, warmup_steps=cfg.lr_schedule.warmup_steps,
                            decay=cfg.lr_schedule.decay, min_lr_ratio=cfg.lr_schedule.min_lr_ratio)
    ckpt = Checkpointer(os.path.join(dump, cfg.checkpoint.folder), keep_last=cfg.checkpoint.keep_last,
                        async_save=cfg.checkpoint.async_save, model_only=cfg.checkpoint.model_only)
    start = 0
    if (last := resume_step(ckpt, cfg.checkpoint, steps, info.is_main,
                            logs=[os.path.join(dump, "metrics.jsonl")])) is not None:
        state = ckpt.load(last, model, opt)
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
        if info.is_main:
            note = resume_note(state, info.world_size)
            print(f"resumed from {ckpt.path(last)} at step {start}{note}", flush=True)

    data, dp, micro, batch = setup.data, setup.dp, cfg.training.micro_batch_size, cfg.training.batch_size
    sampler = StepSampler(len(data.train), batch, cfg.job.seed, cfg.data.shuffle)
    logger = MetricsLogger(dump, enabled=info.is_main, jsonl=cfg.metrics.jsonl, tensorboard=cfg.metrics.tensorboard,
                           console_keys=console_keys)
    eval_every = cfg.preference.eval_interval
    model.train()
    for step in range(start, steps):
        t0 = time.monotonic()
        pairs = [data.train[i] for i in sampler.local_batch(step, setup.rank_dp, dp)]
        sums: dict[str, Tensor] = {}
        for m0 in range(0, len(pairs), micro):
            loss, metrics = micro_fn(pairs[m0:m0 + micro], "train")
            # FSDP averages gradients over dp ranks: this makes the result the mean over the global batch.
            (loss.sum() * (dp / batch)).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.double().sum()
        grad_norm = clip_grad_norm(model.parameters(), cfg.optimizer.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        names = list(sums)
        tokens = sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs)
        total = torch.stack([sums[k] for k in names] + [torch.tensor(float(tokens), dtype=torch.float64,
                                                                     device=info.device)])
        dist.all_reduce(total)  # one host sync per step, for the metrics row
        values = total.tolist()
        done = step + 1
        row = {k: v / batch for k, v in zip(names, values)}
        if (eval_every and done % eval_every == 0) or done == steps:
            row.update(_evaluate(model, micro_fn, setup, micro, info.device))
        if done % cfg.metrics.log_interval == 0 or done == steps:
            dt = time.monotonic() - t0
            logger.log(done, {**row, "grad_norm": grad_norm, "lr": lr, "pairs_per_s": batch / dt,
                              "tokens_per_s": values[-1] / dt, "epoch": sampler.epoch_of(step), "step_time_s": dt,
                              "peak_memory_gb": peak_memory_gb(info.device),
                              "skipped_rows": sum(data.skipped.values())}, total_steps=steps)
        ckpt.poll()  # commits an asynchronous save whose write has finished
        if cfg.checkpoint.enable and (done % cfg.checkpoint.interval == 0 or done == steps):
            secs = ckpt.save(done, model, opt, {"step": done, "scheduler": sched.state_dict()})
            if done == steps:
                ckpt.wait()
            if info.is_main:
                print(f"checkpoint step-{done} saved in {secs:.2f}s"
                      f"{' (writing in the background)' if ckpt.pending_step else ''}", flush=True)
    if cfg.checkpoint.export_hf_at_end:
        out = export()
        if info.is_main:
            print(f"exported model to {out}", flush=True)
    logger.close()
    return 0


# ---------------------------------------------------------------------- the dpo recipe
def run_preference(cfg, info: DistInfo) -> int:
    """The ``dpo`` recipe: any loss in PREFERENCE_LOSSES against a frozen reference (or none)."""
    setup = setup_pairs(cfg, info, "dpo")
    pcfg = cfg.preference
    loss_fn, loss_cfg = PREFERENCE_LOSSES.get(pcfg.loss), pcfg.loss_config()
    reference = pcfg.reference
    if _needs_reference(loss_fn, loss_cfg):
        if reference == "none":
            raise ConfigError(f"preference.reference: loss {pcfg.loss!r} needs reference log-probs; "
                              "set 'precompute' or 'online'")
    elif reference != "none":
        if info.is_main:
            print(f"note: loss {pcfg.loss!r} does not use a reference; preference.reference="
                  f"{reference!r} ignored", flush=True)
        reference = "none"

    build = dict(path=cfg.model.path, seed=cfg.job.seed, param_dtype=cfg.training.mixed_precision_param,
                 reduce_dtype=cfg.training.mixed_precision_reduce, cpu_offload=cfg.parallel.cpu_offload,
                 is_main=info.is_main)
    policy = build_sharded_model(setup.args, setup.mesh, info.device, activation_checkpoint=cfg.parallel.activation_checkpoint,
                                 compile=cfg.parallel.compile, **build)
    ref_model = None
    table: dict[str, Tensor] = {}
    if reference == "online":
        ref_model = build_sharded_model(setup.args, setup.mesh, info.device, trainable=False, **build)
    elif reference == "precompute":  # before any checkpoint is loaded: the policy is the reference now
        t0 = time.monotonic()
        kw = dict(micro=cfg.training.micro_batch_size, pad_id=setup.pad_id, device=info.device,
                  rank=setup.rank_dp, dp=setup.dp)
        table = {"train": precompute_reference(policy, setup.data.train, **kw),
                 "eval": precompute_reference(policy, setup.data.eval, **kw)}
        if info.is_main:
            n = len(setup.data.train) + len(setup.data.eval)
            print(f"reference log-probs of {n} pairs precomputed in {time.monotonic() - t0:.1f}s", flush=True)

    def micro_fn(pairs: list[PreferencePair], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        batch = {k: v.to(info.device) for k, v in collate_pairs(pairs, setup.pad_id).items()}
        b = len(pairs)
        logps, lengths = sequence_logps(policy, batch)  # [2B] each: chosen then rejected
        ref_c = ref_r = None
        if ref_model is not None:
            with torch.no_grad():
                ref, _ = sequence_logps(ref_model, batch)
            reshard_all(ref_model)  # frees its last block's unsharded copy (no backward will)
            ref_c, ref_r = ref[:b], ref[b:]
        elif table:
            rows = table[split][torch.tensor([p.index for p in pairs], device=info.device)]  # [B, 2]
            ref_c, ref_r = rows[:, 0], rows[:, 1]
        out = loss_fn(PreferenceInput(logps[:b], logps[b:], ref_c, ref_r, lengths[:b], lengths[b:]), loss_cfg)
        c, r = out.chosen_rewards, out.rejected_rewards
        return out.loss, {"loss": out.loss.detach(), "accuracy": pair_accuracy(c, r), "margin": c - r,
                          "chosen_reward": c, "rejected_reward": r, "chosen_logp": logps[:b].detach(),
                          "rejected_logp": logps[b:].detach()}

    def export() -> str:
        out = os.path.join(cfg.job.dump_folder, "hf")
        export_hf(policy, setup.args, setup.tokenizer, out, info.rank)
        return out

    return run_pair_loop(cfg, info, setup, policy, micro_fn, export=export,
                         console_keys=("loss", "accuracy", "margin", "eval_accuracy", "grad_norm", "lr"))
