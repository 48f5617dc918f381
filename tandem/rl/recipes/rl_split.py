"""The RL recipe in split mode: generator ranks and trainer ranks, concurrently, in one program.

``rollout.mode = "split"``, ``rollout.gen_ranks = G``: ranks ``0 .. G-1`` generate
(`tandem.rl.rollout.split.SplitGenerator`), ranks ``G .. W-1`` train with FSDP2 over
themselves alone (their mesh: `tandem.parallel.split.side_mesh`; the update's collectives that
take no group go to the trainers' group: `tandem.parallel.split.set_side_group`). Each step:
the generators send the step's groups to the trainers; the trainers update, then ask for the
sync and send their shards over the bridge group while the generators keep decoding; both
sides then meet for the step's metrics, the ledger and checkpoints (the shell's collectives
over the whole world). Rank 0, a generator, writes the logs: the trainers' metrics come to
it at the end of every step.

What has run is what is allowed: single-turn rollouts, ``parallel.dp_shard`` only (no tp, pp,
cp, ep or HSDP), ``rollout.tp = 1``, no critic, reference model, teachers or dynamic
sampling (`check_split_settings`: one ConfigError line each).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.kernels import batch_invariant
from tandem.parallel.split import BridgeCopy, set_side_group, split_world
from tandem.rl.algorithms import ADVANTAGES
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.core.optim import build_optimizer
from tandem.rl.core.samples import SampleLog, dump_rollouts
from tandem.rl.recipes.base import CheckpointParts, Runtime, StepOutput, Updater, setup
from tandem.rl.recipes.rl import RLRecipe
from tandem.rl.recipes.rl_settings import check_rl_settings, prompt_room
from tandem.rl.rollout.phase import RolloutPhase
from tandem.rl.rollout.sampling import generation_dtype
from tandem.rl.rollout.split import (
    SplitGenerator,
    evaluate_split,
    receive_groups,
    request_sync,
)
from tandem.rl.rollout.types import RolloutBatch
from tandem.rl.update.phase import UpdatePhase
from tandem.rl.update.policy import build_policy


def check_split_settings(cfg: Any, world: int) -> None:
    """One ConfigError line for a split-mode setting that has not run."""
    g, r, p = cfg.rollout.gen_ranks, cfg.rl, cfg.parallel
    if g >= world:
        raise ConfigError(f"rollout.gen_ranks: {g} leaves no trainer rank of the {world}")
    for key, value in (
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("parallel.cp", p.cp),
        ("parallel.ep", p.ep),
        ("parallel.dp_replicate", p.dp_replicate),
        ("rollout.tp", cfg.rollout.tp),
    ):
        if value > 1:
            raise ConfigError(
                f"{key}: {value} with rollout.mode = 'split' has not run yet (the "
                "trainers shard with FSDP2 alone, each generator holds the whole "
                "model); set it to 1"
            )
    for key, on in (
        ("rl.advantage (a critic)", ADVANTAGES.cap(r.advantage, "needs_values", False)),
        ("rl.kl_coef (a reference model)", r.kl_coef > 0),
        ("distill.teachers", bool(cfg.distill.teachers)),
        ("rl.dynamic_sampling", r.dynamic_sampling),
        ("env.name", bool(cfg.env.name)),
        ("rl.offload_optimizer", r.offload_optimizer),
    ):
        if on:
            raise ConfigError(
                f"{key}: rollout.mode = 'split' has not run with it yet; unset it "
                "or use rollout.mode = 'colocated_async'"
            )


class _Relay:
    """A generator's stand-in for the trainers' `Updater`: the shell logs ``last_lr`` and
    ``skipped`` from rank 0, so the trainers' values come here every step."""

    def __init__(self) -> None:
        self.last_lr, self.skipped = 0.0, 0
        self.skip_steps: set[int] = set()  # the shell's rollback bookkeeping (none in split mode)

    def forget_after(self, step: int) -> None:
        """Nothing to forget: the spike rule runs on the trainers."""


class SplitRLRecipe(RLRecipe):
    """``rollout.mode = "split"`` (the recipe protocol of tandem/rl/recipes/base.py)."""

    def __init__(self, cfg: Any, rt: Runtime) -> None:
        self.cfg, self.info, self.rt = cfg, rt.info, rt
        info, r = rt.info, cfg.rl
        check_split_settings(cfg, info.world_size)
        check_rl_settings(cfg, info, False)
        self.world = world = split_world(cfg.rollout.gen_ranks)
        self.server, self.kv, self.critic = None, None, None
        if r.exact:
            batch_invariant.enable()
        # collective over the world (new groups): every rank makes the trainers' mesh and groups
        s = setup(
            cfg,
            rt,
            "rl",
            batch=("rl.prompts_per_step", r.prompts_per_step),
            ranks=(world.first, world.second),
        )
        self.mesh, self.dp, self.mp = s.mesh, s.dp, 1
        self.tok, self.args, self.dp_rank = s.tokenizer, s.args, s.rank_dp
        dump = rt.dump_folder
        self.max_prompt = prompt_room(cfg)
        self.train_prompts, self.eval_prompts = self._load_data()
        dtype = (
            generation_dtype(cfg.rollout.dtype, info.device, cfg.training.mixed_precision_param)
            or torch.float32
        )
        bucket = cfg.advanced.reshard_bucket_mb << 20
        self.sample_log = SampleLog(
            dump, cfg.metrics.samples_per_step, info.rank == world.first, text_sink=rt.logger.text
        )
        self.step_index = 0
        if world.in_first:
            self._build_generator(dtype, bucket)
        else:
            set_side_group(world.second_group)
            # dp_shard alone: the data-parallel group is the trainers' (a group even of one
            # trainer, so no collective of the update reaches the generators)
            self._build_trainer(world.second_group, dtype, bucket)
        self._first_sync()

    def _build_generator(self, dtype: torch.dtype, bucket: int) -> None:
        cfg, info, w = self.cfg, self.info, self.world
        self.model, self.opt, self.updater = nn.Module(), None, _Relay()
        bridge = BridgeCopy(
            nn.Module(), self.args, info.device, dtype, world=w, bucket_bytes=bucket
        )
        base = RolloutPhase(
            rl=cfg.rl,
            rollout=cfg.rollout,
            reward=cfg.reward,
            env=cfg.env,
            data=cfg.data,
            seed=cfg.job.seed,
            info=info,
            tok=self.tok,
            train=self.train_prompts,
            evals=self.eval_prompts,
            gen_copy=bridge,
            dp=(w.first, w.side_rank, w.first_group),
            mp=(1, 0, None),
            max_prompt=self.max_prompt,
            rollout_dumps=None,
        )
        self.rollout = SplitGenerator(base, w, bridge)

    def _build_trainer(self, dp_group: Any, dtype: torch.dtype, bucket: int) -> None:
        cfg, info, r = self.cfg, self.info, self.cfg.rl
        spec = BuildSpec.from_config(cfg.training, cfg.parallel, cfg.model)
        self.policy = build_policy(
            self.args,
            self.mesh,
            info.device,
            lora=cfg.lora,
            path=cfg.model.path,
            seed=cfg.job.seed,
            spec=spec,
            is_main=True,  # every trainer reads the weights
            pp_schedule=cfg.parallel.pp_schedule,
            pp_microbatches=cfg.advanced.pp_microbatches,
            seq_len=cfg.data.max_length,
            micro_batch_tokens=r.micro_batch_tokens,
            chunk_tokens=cfg.advanced.logprob_chunk_tokens,
            share_prompts=True,
            cp_style=cfg.parallel.cp_style,
        )
        self.model = self.policy.state_module
        o = cfg.optimizer
        self.opt = build_optimizer(
            self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        trainers = self._trainers(0)
        self.updater = Updater(
            [t.learner for t in trainers],
            fault=cfg.fault,
            dump_folder=self.rt.dump_folder,
            rank=info.rank,
        )
        self.bridge = BridgeCopy(
            self.model, self.args, info.device, dtype, world=self.world, bucket_bytes=bucket
        )
        self.rollout = None
        n_log = cfg.metrics.samples_per_step if info.rank == self.world.first else 0
        self.update = UpdatePhase(
            rl=r,
            max_tokens=cfg.rollout.max_tokens,
            distill=cfg.distill,
            policy=self.policy,
            ref=None,
            trainers=trainers,
            updater=self.updater,
            teachers=None,
            dp=(self.dp, dp_group),
            device=info.device,
            samples_to_log=n_log,
            kv=None,
            chunk_tokens=cfg.advanced.logprob_chunk_tokens,
        )

    def _first_sync(self) -> dict[str, float]:
        """Collective over the bridge: the generators' copy of the trainers' current weights."""
        if self.world.in_first:
            return self.rollout.first_sync()
        return self.bridge.send()

    # ---- the recipe protocol ---------------------------------------------------------

    def step(self, step: int) -> StepOutput:
        self.step_index = step
        wd, w = self.rt.watchdog, self.world
        out = StepOutput({})
        if w.in_first:
            with wd.phase("rollout"):
                mine = self.rollout.step(step)
        else:
            t0 = time.monotonic()
            with wd.phase("rollout"):
                groups = receive_groups(w)
            waited = time.monotonic() - t0
            samples = [s for _, group, _ in groups for s in group]
            scores = torch.tensor([v for _, _, sc in groups for v in sc], dtype=torch.float32)
            if self.cfg.advanced.dump_rollouts:  # the trainers' samples, by trainer index
                dump_rollouts(self.rt.dump_folder, step, w.side_rank, samples)
            ids = sorted({str(s.row.get("id", s.row.get("problem_id", ""))) for s in samples})
            batch = RolloutBatch(samples, scores, step, {}, ids, sorted({s.group for s in samples}))
            with wd.phase("update"):
                result = self.update.run(batch, step)
            request_sync(w, step + 1)
            with wd.phase("sync"):
                sync = self.bridge.send()
            mine = {
                **result.metrics,
                **sync,
                "split/train_wait_s": waited,
                "lr": self.updater.last_lr,
                "fault/skipped_updates": float(self.updater.skipped),
            }
            self.sample_log.log(step + 1, self._sample_records(batch, result.advantages))
            out = StepOutput({}, batch.ids, batch.positions)
        out.metrics = self._gather_metrics(mine)
        out.health_group = "generators" if w.in_first else "trainers"  # compared among themselves
        return out

    def _gather_metrics(self, mine: dict[str, float]) -> dict[str, float]:
        """Collective over the world: the first generator's metrics (already over the
        generators) and the first trainer's (already over the trainers), on every rank."""
        parts: list[Any] = [None] * self.world.world
        dist.all_gather_object(parts, mine, group=self.world.control)
        metrics = {**parts[0], **parts[self.world.first]}
        if self.world.in_first:
            self.updater.last_lr = metrics.pop("lr")
            self.updater.skipped = int(metrics.pop("fault/skipped_updates"))
        metrics.pop("lr", None)
        metrics.pop("fault/skipped_updates", None)
        return metrics

    def evaluate(self) -> dict[str, float]:
        if self.world.in_first:
            return self.rollout.evaluate()
        return evaluate_split(None, self.world, None)

    def checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(self.model, self.opt, {})

    def state_dict(self) -> dict[str, Any]:
        """Collective, the same on every rank: the trainers' schedule, the generators' prompt
        stream and what is in flight."""
        if self.world.in_first:
            stream = self.rollout.stream
            mine = {
                "cursor": stream.cursor,
                "requeued": stream.requeued,
                "rollout": self.rollout.state_dict(),
            }
        else:
            mine = {"scheduler": self.sched.state_dict()}
        parts: list[Any] = [None] * self.world.world
        dist.all_gather_object(parts, mine, group=self.world.control)
        return {**parts[self.world.first], **parts[0]}

    def load_state_dict(self, state: dict[str, Any], *, saved_world: int) -> None:
        """Each side takes its part; then the generators take the resumed weights (a sync)."""
        if self.world.in_first:
            stream = self.rollout.stream
            stream.cursor, stream.requeued = state["cursor"], list(state.get("requeued", []))
            self.rollout.load_state_dict(state.get("rollout") or {})
        else:
            self.sched.load_state_dict(state["scheduler"])
        self._first_sync()

    def export(self, dump_folder: str) -> str:
        """The trainers gather the full weights; the first trainer writes the HF folder."""
        out = os.path.join(dump_folder, "hf")
        if not self.world.in_first:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            from tandem.rl.core.lora import save_exports

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            if self.world.side_rank == 0:
                save_exports({k: v.cpu() for k, v in state.items()}, self.args, out, self.tok, None)
        dist.barrier(group=self.world.control)
        return out

    def close(self) -> None:
        batch_invariant.disable()
        if self.rollout is not None:
            self.rollout.close()
        set_side_group(None)
