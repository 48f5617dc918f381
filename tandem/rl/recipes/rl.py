"""The RL recipe: each step a rollout phase, then an update phase, on the same ranks.

The two phases meet through one value, a `RolloutBatch` (this rank's samples, their
behaviour log-probs and policy versions, their scores): `RolloutPhase`
(tandem/rl/rollout/phase.py) samples and scores it, `UpdatePhase`
(tandem/rl/update/phase.py) trains the policy (and a critic) on it. This file builds
both from the config and composes them into one step. Algorithm pieces are registry
names from the config, and what the loop must build for one (a critic, a reference
model) is asked of the registry's capabilities, never of a name. Resume, checkpoints,
preemption, logging and evaluation cadence are the shell's (tandem/rl/recipes/loop.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from tandem.kernels import batch_invariant
from tandem.kernels.weight_quant import FORMATS as WEIGHT_FORMATS
from tandem.models.quant_linear import fake_quant_linears
from tandem.parallel.mesh import subgroup
from tandem.rl.algorithms import ADVANTAGES
from tandem.rl.config.composes import check_composes
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.core.optim import build_optimizer, build_scheduler
from tandem.rl.core.samples import SampleLog
from tandem.rl.data.images import VisionData, release_images
from tandem.rl.data.prompts import encode_prompts, load_prompt_rows, prompt_messages
from tandem.rl.fault.mismatch import MismatchGuard
from tandem.rl.recipes.base import CheckpointParts, Runtime, StepOutput, Updater, setup
from tandem.rl.recipes.rl_settings import derived_tp, episode_server, prompt_room
from tandem.rl.recipes.rl_split import SplitPlacement, split_world_of
from tandem.rl.rollout.modes import ROLLOUT_MODES
from tandem.rl.rollout.phase import RolloutPhase
from tandem.rl.rollout.sampling import generation_copy, generation_dtype
from tandem.rl.rollout.types import RolloutBatch
from tandem.rl.update.critic import Critic
from tandem.rl.update.kv_scales import KVScales
from tandem.rl.update.learners import CriticTrainer, PolicyTrainer
from tandem.rl.update.lora_reference import frozen_reference
from tandem.rl.update.phase import UpdatePhase
from tandem.rl.update.policy import build_policy, check_layout
from tandem.rl.update.teachers import Teachers


class RLRecipe:
    console_keys = (
        "reward/total",
        "accuracy",
        "response/length_mean",
        "kl",
        "entropy",
        "clip_frac",
        "grad_norm",
        "gap/abs_mean",
        "time/rollout_s",
        "time/update_s",
    )

    def __init__(self, cfg: Any, rt: Runtime) -> None:
        self.cfg, self.info, self.rt = cfg, rt.info, rt
        info, r = rt.info, cfg.rl
        # the placement: every rank generates and trains (None), or split mode's two sides
        self.world = split_world_of(cfg, info.world_size)
        w = self.world
        self.needs_values = ADVANTAGES.cap(r.advantage, "needs_values", False)
        ranks = None if w is None else (w.first, w.second)
        s = setup(cfg, rt, "rl", batch=("rl.prompts_per_step", r.prompts_per_step), ranks=ranks)
        self.degrees = degrees = s.degrees
        self.mp = degrees.tp * degrees.pp * degrees.cp  # ranks sharing one replica's samples
        if r.exact:  # process-wide, like torch.use_deterministic_algorithms: both phases run in it
            batch_invariant.enable()
        self.mesh, self.dp, self.tok, self.args = s.mesh, s.dp, s.tokenizer, s.args
        self.dp_rank, self.facts = s.rank_dp, s.facts
        check_layout(self.args, degrees, cfg.parallel.pp_schedule, cfg.parallel.cp_style)
        self.max_prompt = prompt_room(cfg)
        self.train_prompts, self.eval_prompts = self._load_data()
        writer = info.is_main if w is None else info.rank == w.first  # a trainer in split mode
        self.sample_log = SampleLog(
            rt.dump_folder, cfg.metrics.samples_per_step, writer, text_sink=rt.logger.text
        )
        self.step_index = 0  # the step being taken (the shell's count)
        self.server = self.kv = self.critic = self.rollout = self.placement = None
        if w is None:
            self._colocated()
        else:
            self.placement = SplitPlacement(self, w)

    def _colocated(self) -> None:
        """Every rank trains the policy and generates from its generation copy."""
        cfg, info = self.cfg, self.info
        dp_group = subgroup(self.mesh, ("dp_replicate", "dp_shard"))
        mp_group = subgroup(self.mesh, ("pp", "cp", "tp"))
        mp_rank = dist.get_rank(mp_group) if mp_group is not None else 0
        self.build_policy(group=None)
        gen_copy = generation_copy(
            self.policy,
            self.args,
            cfg.rollout,
            info,
            generation_dtype(cfg.rollout.dtype, info.device, cfg.training.mixed_precision_param),
            offload_optimizer=cfg.rl.offload_optimizer,
            reference=cfg.rl.kl_coef > 0 and not cfg.lora.enabled,
            critic=self.needs_values,
            bucket_bytes=cfg.advanced.reshard_bucket_mb << 20,
            tp=derived_tp(cfg, info),
        )
        self.build_update(dp_group)
        self.rollout = self._rollout_phase(
            gen_copy,
            self.train_prompts,
            self.eval_prompts,
            cfg.env.kind == "http",  # a harness plays the episodes (tandem/rl/generator/serve)
            dp=(self.dp, self.dp_rank, dp_group),
            mp=(self.mp, mp_rank, mp_group),
        )

    # ---- the update side, the same in every placement ---------------------------------

    def build_policy(self, group: Any) -> None:
        """The policy, trained over ``group`` (None: the whole world)."""
        cfg, info, r, advanced = self.cfg, self.info, self.cfg.rl, self.cfg.advanced
        seq_len = cfg.data.max_length
        if cfg.env.name or cfg.env.kind == "http":
            seq_len = self.max_prompt + cfg.env.max_total_tokens
        self.spec = BuildSpec.from_config(cfg.training, cfg.parallel, cfg.model)
        self.policy_kw = dict(
            path=cfg.model.path,
            seed=cfg.job.seed,
            spec=self.spec,
            # a mesh over part of the world (split): every rank reads the weights
            is_main=info.is_main if self.world is None else True,
            pp_schedule=cfg.parallel.pp_schedule,
            pp_microbatches=advanced.pp_microbatches,
            seq_len=seq_len,
            micro_batch_tokens=r.micro_batch_tokens,
            chunk_tokens=advanced.logprob_chunk_tokens,
            share_prompts=cfg.parallel.pp == 1
            if advanced.share_prompts is None
            else advanced.share_prompts,
            cp_style=cfg.parallel.cp_style,
            group=group,
        )
        self.policy = build_policy(
            self.args, self.mesh, info.device, lora=cfg.lora, **self.policy_kw
        )
        self.model = self.policy.state_module  # the full model's parameter names (checkpoints)
        if r.quantize_update:  # the generator's low-bit weights, rounded the same way here
            for m in self.policy.modules:
                fake_quant_linears(m, WEIGHT_FORMATS[cfg.rollout.weight_dtype])

    def build_update(self, dp_group: Any) -> None:
        """What trains beside the policy (`build_policy` first): the reference, the FP8 KV
        scales, the optimizer, the critic, the teachers, the learners and the update phase,
        each over the policy's ranks."""
        cfg, info, r, o = self.cfg, self.info, self.cfg.rl, self.cfg.optimizer
        is_main, group = self.policy_kw["is_main"], self.policy.group
        ref = None
        if r.kl_coef > 0:  # LoRA: the policy with its adapters off
            ref = frozen_reference(
                self.policy,
                lambda: build_policy(
                    self.args, self.mesh, info.device, trainable=False, **self.policy_kw
                ),
            )
        self.kv = KVScales.create(cfg.rollout, self.args, self.policy, ref)  # FP8 KV or None
        self.mismatch = (  # rl.max_mismatch_kl's window, or None
            None
            if r.max_mismatch_kl is None
            else MismatchGuard(r.max_mismatch_kl, r.mismatch_window)
        )
        self.opt = build_optimizer(
            self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        if self.needs_values:
            self.critic = Critic(
                cfg.critic,
                o,
                self.args,
                self.mesh,
                info.device,
                self.spec,
                policy_path=cfg.model.path,
                seed=cfg.job.seed,
                is_main=is_main,
                cp=self.policy.split,
            )
        warmup = cfg.critic.warmup_steps if self.critic is not None else 0
        teachers = None
        if cfg.distill.teachers:
            teachers = self._teachers(self.train_prompts + self.eval_prompts, is_main)
        trainers = self._trainers(warmup)
        self.updater = Updater(
            [t.learner for t in trainers],
            fault=cfg.fault,
            dump_folder=self.rt.dump_folder,
            rank=info.rank,
            group=group,
        )
        self.update = UpdatePhase(
            rl=r,
            max_tokens=cfg.rollout.max_tokens,
            distill=cfg.distill,
            policy=self.policy,
            ref=ref,
            trainers=trainers,
            updater=self.updater,
            teachers=teachers,
            dp=(self.dp, dp_group),
            device=info.device,
            samples_to_log=cfg.metrics.samples_per_step if self.sample_log.enabled else 0,
            kv=self.kv,
            chunk_tokens=cfg.advanced.logprob_chunk_tokens,
        )

    def _rollout_phase(
        self,
        gen_copy: Any,
        train: list[Any],
        evals: list[Any],
        http: bool,
        *,
        dp: tuple[int, int, Any],
        mp: tuple[int, int, Any],
    ) -> Any:
        """The rollout phase in ``rollout.mode``; with ``env.kind = "http"`` the endpoint starts
        (rank 0) and plays the episodes."""
        cfg, info = self.cfg, self.info
        # env.kind = "http": the endpoint, or None
        self.server = episode_server(cfg, info, self.tok)
        self.gen_layout = gen_copy.layout
        check_composes(self.facts.but(rollout_tp=gen_copy.layout.tp))
        return ROLLOUT_MODES.get(cfg.rollout.mode)(
            RolloutPhase(
                rl=cfg.rl,
                rollout=cfg.rollout,
                reward=cfg.reward,
                env=cfg.env,
                data=cfg.data,
                seed=cfg.job.seed,
                info=info,
                tok=self.tok,
                train=train,
                evals=evals,
                gen_copy=gen_copy,
                dp=dp,
                mp=mp,
                max_prompt=self.max_prompt,
                rollout_dumps=self.rt.dump_folder if cfg.advanced.dump_rollouts else None,
                optimizer=self.opt if cfg.rl.offload_optimizer else None,
                kv=self.kv,
                kv_ready=self._kv_ready,
                episodes=self._serve if http else None,
            )
        )

    def _teachers(self, prompts: list[Any], is_main: bool) -> Teachers:
        cfg, info = self.cfg, self.info
        teachers = Teachers(
            cfg.distill,
            self.tok,
            self.mesh,
            info.device,
            self.spec,
            seed=cfg.job.seed,
            is_main=is_main,
            conversation=self._conversation,
            group=self.policy.group,
            cp=self.policy.split,
        )
        check_composes(self.facts.but(cross_tokenizer=teachers.cross_tokenizer))
        teachers.check_rows([p.row for p in prompts])  # fail now, not mid-run
        return teachers

    def _trainers(self, warmup: int) -> list[Any]:
        """The learners of the update, policy first, and the policy's LR schedule, whose optimizer
        steps exclude the critic's warm-up steps."""
        cfg, r, o = self.cfg, self.cfg.rl, self.cfg.optimizer
        per_batch = r.epochs * r.minibatches
        ls = cfg.lr_schedule
        total = max(cfg.training.steps - warmup, 1) * per_batch
        self.sched = build_scheduler(
            self.opt,
            total_steps=total,
            warmup_steps=ls.warmup_steps * per_batch,
            decay=ls.decay,
            min_lr_ratio=ls.min_lr_ratio,
        )
        trainers: list[Any] = [
            PolicyTrainer(
                self.policy,
                self.opt,
                self.sched,
                max_grad_norm=o.max_grad_norm,
                warmup_steps=warmup,
            )
        ]
        if self.critic is not None:
            trainers.append(
                CriticTrainer(self.critic, self.policy, max_grad_norm=o.max_grad_norm, dp=self.dp)
            )
        return trainers

    def _load_data(self):
        d = self.cfg.data
        kw = dict(
            prompt_field=d.prompt_field,
            messages_field=d.messages_field,
            answer_field=d.answer_field,
            max_prompt_tokens=self.max_prompt,
            on_bad_row=d.on_bad_row,
        )
        rows = load_prompt_rows(
            d.path, d.format, split="train", seed=self.cfg.job.seed, n_synthetic=d.synthetic_rows
        )
        train, skipped = encode_prompts(
            rows, self.tok, source=d.path, vision=VisionData.for_model(self.args, d.path), **kw
        )
        eval_path = d.eval_path or (d.path if d.path.startswith("synthetic:") else None)
        evals = []
        if eval_path:
            erows = load_prompt_rows(
                eval_path,
                d.format,
                split="test",
                seed=self.cfg.job.seed + 1,
                n_synthetic=self.cfg.rl.eval_prompts,
            )
            evals, _ = encode_prompts(
                erows[: self.cfg.rl.eval_prompts],
                self.tok,
                source=eval_path,
                vision=VisionData.for_model(self.args, eval_path),
                **kw,
            )
        if self.info.is_main:
            print(
                f"data: {len(train)} train prompts, {len(evals)} eval prompts; skipped "
                f"{sum(skipped.values())} {skipped}",
                flush=True,
            )
        return train, evals

    def _conversation(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat turns a row's prompt was rendered from (what another tokenizer's
        teacher renders)."""
        return prompt_messages(row, self.cfg.data.prompt_field, self.cfg.data.messages_field)

    # ---- the recipe protocol (tandem/rl/recipes/base.py) -------------------------------------

    def step(self, step: int) -> StepOutput:
        wd = self.rt.watchdog
        self.step_index = step
        if self.placement is not None:
            return self.placement.step(step)
        with wd.phase("rollout"):
            batch = self.rollout.batch(step)
        with wd.phase("update"):
            result = self.update.run(batch, step)
        release_images(batch.samples)  # the step's pixels (decoded once for the rollout and update)
        metrics = {**batch.metrics, **result.metrics, **self.rollout.sample_metrics(batch.samples)}
        self.sample_log.log(step + 1, self.sample_records(batch, result.advantages))
        if self.mismatch is not None:  # MismatchError (exit 12) on every rank at once
            self.mismatch.observe(step, metrics)
        return StepOutput(metrics, batch.ids, batch.positions)

    def evaluate(self) -> dict[str, float]:
        if self.placement is not None:
            return self.placement.evaluate()
        return self.rollout.evaluate()

    def checkpoint_parts(self) -> CheckpointParts:
        extras = self.critic.checkpoint_extras() if self.critic is not None else {}
        return CheckpointParts(self.model, self.opt, extras)

    def state_dict(self) -> dict[str, Any]:
        """Collective, the same on every rank: the schedule, the prompt stream's position and
        given-back prompts, and what is in flight between the phases (asynchronous modes:
        prompt groups and their partial samples)."""
        if self.placement is not None:
            return self.placement.state_dict()
        stream = self.rollout.stream
        kv = {"kv_scales": self.kv.state_dict()} if self.kv else {}
        if self.mismatch is not None:
            kv["mismatch"] = self.mismatch.state_dict()
        return {
            "scheduler": self.sched.state_dict(),
            "cursor": stream.cursor,
            "requeued": stream.requeued,
            "rollout": self.rollout.state_dict(),
            **kv,
        }

    def load_state_dict(self, state: dict[str, Any], *, saved_world: int) -> None:
        """The prompt stream's position is global, so any world size continues where the saved
        run stopped (and samples what it would have: seeds are keyed by position, not rank)."""
        if self.placement is not None:
            return self.placement.load_state_dict(state)
        self.sched.load_state_dict(state["scheduler"])
        if self.kv is not None and "kv_scales" in state:
            self.kv.load_state_dict(state["kv_scales"])
        if self.mismatch is not None and "mismatch" in state:
            self.mismatch.load_state_dict(state["mismatch"])
        if "cursor" in state:
            self.rollout.stream.cursor = state["cursor"]
        else:
            # a checkpoint from before the global stream: per-rank cursors over dp interleaved ranks
            self.rollout.stream.cursor = max(state["cursors"]) * state["dp"]
        self.rollout.stream.requeued = list(state.get("requeued", []))
        self.rollout.load_state_dict(state.get("rollout") or {})

    def sample_records(self, batch: RolloutBatch, advantages: list[float]) -> list[dict[str, Any]]:
        """The first ``metrics.samples_per_step`` samples of this rank as samples.jsonl records
        (the writing rank writes its own: the first prompts' groups, whose advantages are
        relative to each other)."""
        n = (
            min(self.cfg.metrics.samples_per_step, len(batch.samples))
            if self.sample_log.enabled
            else 0
        )
        return [
            {
                "prompt": self.tok.decode(s.prompt_ids),
                "completion": s.text,
                "reward": float(batch.scores[i]),
                "rewards": s.info.get("rewards", {}),
                "advantage": advantages[i] if advantages else None,
                "finish_reason": s.finish_reason,
                "completion_tokens": len(s.completion_ids),
                "id": str(s.row.get("id", s.row.get("problem_id", ""))),
            }
            for i, s in enumerate(batch.samples[:n])
        ]

    def export(self, dump_folder: str) -> str:
        if self.placement is not None:
            return self.placement.export(dump_folder)
        out = os.path.join(dump_folder, "hf")
        self.policy.export_hf(self.args, self.tok, out, self.info.rank)
        return out

    def close(self) -> None:
        batch_invariant.disable()
        if self.rollout is not None:  # a trainer in split mode has none
            self.rollout.close()
        if self.server is not None:
            self.server.stop(grace_s=2.0)  # polling harnesses hear that the run is done

    def _serve(
        self, gen_model: Any, prompts: list[Any], n: int, seeds: list[int], greedy: bool = False
    ) -> tuple[list[Any], dict[str, float]]:
        """``env.kind = "http"``: the step's episodes, played by a harness over the endpoint."""
        from tandem.rl.rollout.episodes import serve_episodes

        layout = self.gen_layout
        return serve_episodes(
            self.server,
            gen_model,
            self.tok,
            prompts,
            n,
            self.cfg.rollout,
            self.cfg.env,
            seeds=seeds,
            greedy=greedy,
            layout=layout,
            version=self.step_index,
            beat=self.rt.watchdog.beat,
            stop=self.rt.stop_requested,
            kv_scales=None if self.kv is None else self.kv.for_heads(layout.tp, layout.rank),
        )

    def _kv_ready(self) -> dict[str, float]:
        """Collective: FP8 KV scales exist before anything samples (the first calibration)."""
        return self.kv.ensure(self.policy, self.train_prompts, self.step_index) if self.kv else {}


def make_rl(cfg: Any, rt: Runtime) -> RLRecipe:
    """The RL recipe, in any rollout mode and placement."""
    return RLRecipe(cfg, rt)
