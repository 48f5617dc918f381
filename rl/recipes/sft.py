"""Supervised fine-tuning trainer: packed chat data, FSDP2, exact resume.

The loss is the token-mean cross-entropy over the assistant tokens of the
whole optimizer step (all micro-batches, all data-parallel ranks), so the
update does not depend on how the batch is split across ranks or micro-batches.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.attention import DocumentAttention
from parallel.distributed import DistInfo
from parallel.grad import clip_grad_norm
from parallel.mesh import Degrees, build_mesh, dp_rank
from rl.data.sft import IGNORE, StepSampler, build_sft_data, collate, load_sft_records
from rl.fault import PreemptionHandler, Watchdog, check_finite
from rl.runtime.checkpoint import Checkpointer, resume_note, resume_step
from rl.runtime.config import ConfigError
from rl.runtime.errors import EXIT_PREEMPTED
from rl.runtime.metrics import MetricsLogger, truncate_jsonl
from rl.runtime.modeling import build_sharded_model, build_tokenizer, export_hf, model_args
from rl.runtime.optim import build_optimizer, build_scheduler
from rl.runtime.system import peak_memory_gb


def run_sft(cfg, info: DistInfo) -> int:
    degrees = Degrees(**cfg.parallel.resolve(info.world_size))
    if degrees.tp > 1 or degrees.pp > 1:
        raise ConfigError("parallel.tp / parallel.pp: the sft recipe shards with FSDP2 only so far; set tp = pp = 1")
    mesh = build_mesh(degrees, info.device)
    dump = cfg.job.dump_folder
    torch.manual_seed(cfg.job.seed + info.rank)

    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.path, os.path.join(dump, "tokenizer"))
    args = model_args(cfg.model.flavor, cfg.model.path, tokenizer)
    if cfg.data.path is None:
        raise ConfigError("data.path: required by the sft recipe")
    data = build_sft_data(
        load_sft_records(cfg.data.path, cfg.data.format, seed=cfg.job.seed, n_synthetic=cfg.data.synthetic_rows),
        tokenizer, source=cfg.data.path,
        max_length=cfg.data.max_length, pack=cfg.data.pack, on_bad_row=cfg.data.on_bad_row,
        messages_field=cfg.data.messages_field, prompt_field=cfg.data.prompt_field,
        completion_field=cfg.data.completion_field,
    )
    if info.is_main:
        skipped = sum(data.skipped.values())
        print(f"data: {data.num_examples} examples -> {len(data.rows)} rows; skipped {skipped} {dict(data.skipped)}", flush=True)

    model = build_sharded_model(args, mesh, info.device, path=cfg.model.path, seed=cfg.job.seed,
                                param_dtype=cfg.training.mixed_precision_param,
                                reduce_dtype=cfg.training.mixed_precision_reduce,
                                cpu_offload=cfg.parallel.cpu_offload, is_main=info.is_main,
                                activation_checkpoint=cfg.parallel.activation_checkpoint,
                                compile=cfg.parallel.compile)

    opt = build_optimizer(model, lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                          weight_decay=cfg.optimizer.weight_decay)
    sched = build_scheduler(opt, total_steps=cfg.training.steps, warmup_steps=cfg.lr_schedule.warmup_steps,
                            decay=cfg.lr_schedule.decay, min_lr_ratio=cfg.lr_schedule.min_lr_ratio)
    ckpt = Checkpointer(os.path.join(dump, cfg.checkpoint.folder), keep_last=cfg.checkpoint.keep_last,
                        async_save=cfg.checkpoint.async_save, model_only=cfg.checkpoint.model_only)
    start = 0
    if (last := resume_step(ckpt, cfg.checkpoint, cfg.training.steps, info.is_main,
                            logs=[os.path.join(dump, "metrics.jsonl")])) is not None:
        state = ckpt.load(last, model, opt)
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
        if info.is_main:
            truncate_jsonl(os.path.join(dump, "metrics.jsonl"), start)
        if info.is_main:
            note = resume_note(state, info.world_size)
            print(f"resumed from {ckpt.path(last)} at step {start}{note}", flush=True)

    dp, rank_dp = degrees.dp, dp_rank(mesh)
    if cfg.training.batch_size % dp:
        raise ConfigError(f"training.batch_size: {cfg.training.batch_size} is not divisible by the {dp} data-parallel ranks")
    sampler = StepSampler(len(data.rows), cfg.training.batch_size, cfg.job.seed, cfg.data.shuffle)
    logger = MetricsLogger(dump, enabled=info.is_main, jsonl=cfg.metrics.jsonl, tensorboard=cfg.metrics.tensorboard,
                           console_keys=("loss", "grad_norm", "lr", "tokens_per_s", "epoch"))
    micro = cfg.training.micro_batch_size
    skipped_steps = 0
    watchdog = Watchdog(dump, cfg.fault.hang_timeout_s, info.rank).start()
    preempt = PreemptionHandler(dump, info.rank).install()
    try:
        for step in range(start, cfg.training.steps):
            t0 = time.monotonic()
            rows = [data.rows[i] for i in sampler.local_batch(step, rank_dp, dp)]
            counts = torch.tensor([sum(r.num_targets for r in rows), sum(len(r.tokens) for r in rows)], dtype=torch.float64)
            dist.all_reduce(counts)  # global trained tokens and tokens this step
            global_targets = max(counts[0].item(), 1.0)
            loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
            model.train()
            for m0 in range(0, len(rows), micro):
                batch = {k: v.to(info.device) for k, v in collate(rows[m0:m0 + micro], tokenizer.pad_token_id or 0).items()}
                logits = model(batch["tokens"], positions=batch["positions"], attn=DocumentAttention(batch["doc_ids"]))
                tok_loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten(),
                                           ignore_index=IGNORE, reduction="sum")
                # FSDP averages gradients over dp ranks: scale so the result is the global token mean.
                (tok_loss * (dp / global_targets)).backward()
                loss_sum += tok_loss.detach().double()
            grad_norm = 0.0
            lr = sched.get_last_lr()[0]
            if check_finite(loss_sum, model, step + 1, info.rank, cfg.fault.on_nonfinite, dump_folder=dump):
                grad_norm = clip_grad_norm(model.parameters(), cfg.optimizer.max_grad_norm)
                opt.step()
            else:  # fault.on_nonfinite = "skip": the step is counted and its update dropped
                skipped_steps += 1
            sched.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum)
            done = step + 1
            watchdog.beat(done)
            if done % cfg.metrics.log_interval == 0 or done == cfg.training.steps:
                dt = time.monotonic() - t0
                logger.log(done, {"loss": loss_sum.item() / global_targets, "grad_norm": grad_norm, "lr": lr,
                                  "tokens_per_s": counts[1].item() / dt, "trained_tokens": counts[0].item(),
                                  "epoch": sampler.epoch_of(step), "step_time_s": dt,
                                  "peak_memory_gb": peak_memory_gb(info.device),
                                  "skipped_rows": sum(data.skipped.values()), "fault/skipped_steps": skipped_steps},
                           total_steps=cfg.training.steps)
            ckpt.poll()  # commits an asynchronous save whose write has finished
            if cfg.checkpoint.enable and (done % cfg.checkpoint.interval == 0 or done == cfg.training.steps):
                with watchdog.phase("checkpoint"):
                    secs = ckpt.save(done, model, opt, {"step": done, "scheduler": sched.state_dict()})
                    if done == cfg.training.steps:
                        ckpt.wait()
                if info.is_main:
                    print(f"checkpoint step-{done} saved in {secs:.2f}s"
                          f"{' (writing in the background)' if ckpt.pending_step else ''}", flush=True)
            if done < cfg.training.steps and preempt.should_stop_all(step=done):
                with watchdog.phase("checkpoint"):
                    if not (cfg.checkpoint.enable and done % cfg.checkpoint.interval == 0):
                        ckpt.save(done, model, opt, {"step": done, "scheduler": sched.state_dict()})
                    ckpt.wait()
                if info.is_main:
                    print(f"preempted: checkpointed step {done}; exiting with {EXIT_PREEMPTED} to requeue", flush=True)
                return EXIT_PREEMPTED
    finally:
        watchdog.stop()
        preempt.uninstall()
    if cfg.checkpoint.export_hf_at_end:
        out = os.path.join(dump, "hf")
        export_hf(model, args, tokenizer, out, info.rank)
        if info.is_main:
            print(f"exported HF model to {out}", flush=True)
    logger.close()
    return 0
