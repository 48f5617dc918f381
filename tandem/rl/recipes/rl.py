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
from tandem.parallel.mesh import subgroup
from tandem.rl.algorithms import ADVANTAGES
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.core.optim import build_optimizer, build_scheduler
from tandem.rl.core.samples import SampleLog
from tandem.rl.data.images import VisionData, release_images
from tandem.rl.data.prompts import encode_prompts, load_prompt_rows, prompt_messages
from tandem.rl.recipes.base import CheckpointParts, Runtime, StepOutput, Updater, setup
from tandem.rl.recipes.rl_settings import check_rl_settings, episode_server, prompt_room
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
from tandem.rl.update.vision import check_vision_policy


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
        info = rt.info
        r, advanced = cfg.rl, cfg.advanced
        needs_values = ADVANTAGES.cap(r.advantage, "needs_values", False)
        http = cfg.env.kind == "http"  # a harness plays the episodes (tandem/rl/serve)
        check_rl_settings(cfg, info, needs_values)
        s = setup(cfg, rt, "rl", batch=("rl.prompts_per_step", r.prompts_per_step), fsdp_only=False)
        degrees = s.degrees
        self.mp = degrees.tp * degrees.pp * degrees.cp  # ranks sharing one replica's samples
        if r.exact:  # process-wide, like torch.use_deterministic_algorithms: both phases run in it
            batch_invariant.enable()
        self.mesh, self.dp, self.tok, self.args = s.mesh, s.dp, s.tokenizer, s.args
        dp_group = subgroup(self.mesh, ("dp_replicate", "dp_shard"))
        mp_group = subgroup(self.mesh, ("pp", "cp", "tp"))
        mp_rank = dist.get_rank(mp_group) if mp_group is not None else 0
        dump = rt.dump_folder
        check_vision_policy(cfg, self.args, self.mp)
        check_layout(
            self.args, degrees, cfg.parallel.pp_schedule, cfg.parallel.cp_style, cfg.parallel.ep
        )
        self.max_prompt = prompt_room(cfg)
        train_prompts, eval_prompts = self._load_data()
        self.train_prompts = train_prompts
        seq_len = cfg.data.max_length
        if cfg.env.name or http:
            seq_len = self.max_prompt + cfg.env.max_total_tokens
        spec = BuildSpec.from_config(cfg.training, cfg.parallel, cfg.model)
        kw = dict(
            path=cfg.model.path,
            seed=cfg.job.seed,
            spec=spec,
            is_main=info.is_main,
            pp_schedule=cfg.parallel.pp_schedule,
            pp_microbatches=advanced.pp_microbatches,
            seq_len=seq_len,
            micro_batch_tokens=r.micro_batch_tokens,
            chunk_tokens=advanced.logprob_chunk_tokens,
            share_prompts=degrees.pp == 1
            if advanced.share_prompts is None
            else advanced.share_prompts,
            cp_style=cfg.parallel.cp_style,
        )
        self.policy = build_policy(self.args, self.mesh, info.device, lora=cfg.lora, **kw)
        self.model = self.policy.state_module  # the full model's parameter names (checkpoints)
        gen_dtype = generation_dtype(
            cfg.rollout.dtype, info.device, cfg.training.mixed_precision_param
        )
        gen_copy = generation_copy(
            self.policy,
            self.args,
            cfg.rollout,
            info,
            gen_dtype,
            offload_optimizer=r.offload_optimizer,
            reference=r.kl_coef > 0 and not cfg.lora.enabled,
            critic=needs_values,
            bucket_bytes=advanced.reshard_bucket_mb << 20,
        )
        ref = None
        if r.kl_coef > 0:  # LoRA: the policy with its adapters off
            ref = frozen_reference(
                self.policy,
                lambda: build_policy(self.args, self.mesh, info.device, trainable=False, **kw),
            )
        self.kv = KVScales.create(cfg.rollout, self.args, self.policy, ref)  # FP8 KV or None
        self.step_index = 0  # the step being taken (the shell's count)
        o = cfg.optimizer
        self.opt = build_optimizer(
            self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.critic = (
            Critic(
                cfg.critic,
                o,
                self.args,
                self.mesh,
                info.device,
                spec,
                policy_path=cfg.model.path,
                seed=cfg.job.seed,
                is_main=info.is_main,
                cp=self.policy.split,
            )
            if needs_values
            else None
        )
        warmup = cfg.critic.warmup_steps if self.critic is not None else 0
        teachers = None
        if cfg.distill.teachers:
            teachers = self._teachers(spec, train_prompts + eval_prompts)
        trainers = self._trainers(warmup)
        self.updater = Updater(
            [t.learner for t in trainers], fault=cfg.fault, dump_folder=dump, rank=info.rank
        )
        self.rollout = self._rollout_phase(
            gen_copy,
            train_prompts,
            eval_prompts,
            http,
            dp=(self.dp, s.rank_dp, dp_group),
            mp=(self.mp, mp_rank, mp_group),
        )
        n_log = cfg.metrics.samples_per_step if info.is_main else 0
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
            samples_to_log=n_log,
            kv=self.kv,
            chunk_tokens=advanced.logprob_chunk_tokens,
        )
        self.sample_log = SampleLog(
            dump, cfg.metrics.samples_per_step, info.is_main, text_sink=rt.logger.text
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
        mode = cfg.rollout.mode
        if ROLLOUT_MODES.cap(mode, "streams") and gen_copy.layout.tp > 1:
            raise ConfigError(
                f"rollout.mode: {mode!r} runs with rollout.tp = 1 only so far, "
                f"got {gen_copy.layout.tp}"
            )
        return ROLLOUT_MODES.get(mode)(
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

    def _teachers(self, spec: BuildSpec, prompts: list[Any]) -> Teachers:
        cfg, info = self.cfg, self.info
        teachers = Teachers(
            cfg.distill,
            self.tok,
            self.mesh,
            info.device,
            spec,
            seed=cfg.job.seed,
            is_main=info.is_main,
            conversation=self._conversation,
        )
        if teachers.cross_tokenizer and cfg.env.name:
            raise ConfigError(
                "distill.teachers: a teacher with another tokenizer scores "
                "single-turn "
                "completions only so far; env.name (multi-turn episodes) needs "
                "teachers with the student's tokenizer"
            )
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
        with wd.phase("rollout"):
            batch = self.rollout.batch(step)
        with wd.phase("update"):
            result = self.update.run(batch, step)
        release_images(batch.samples)  # the step's pixels (decoded once for the rollout and update)
        metrics = {**batch.metrics, **result.metrics, **self.rollout.sample_metrics(batch.samples)}
        self.sample_log.log(step + 1, self._sample_records(batch, result.advantages))
        return StepOutput(metrics, batch.ids, batch.positions)

    def evaluate(self) -> dict[str, float]:
        return self.rollout.evaluate()

    def checkpoint_parts(self) -> CheckpointParts:
        extras = self.critic.checkpoint_extras() if self.critic is not None else {}
        return CheckpointParts(self.model, self.opt, extras)

    def state_dict(self) -> dict[str, Any]:
        """Collective, the same on every rank: the schedule, the prompt stream's position and
        given-back prompts, and what is in flight between the phases (asynchronous modes:
        prompt groups and their partial samples)."""
        stream = self.rollout.stream
        kv = {"kv_scales": self.kv.state_dict()} if self.kv else {}
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
        self.sched.load_state_dict(state["scheduler"])
        if self.kv is not None and "kv_scales" in state:
            self.kv.load_state_dict(state["kv_scales"])
        if "cursor" in state:
            self.rollout.stream.cursor = state["cursor"]
        else:
            # a checkpoint from before the global stream: per-rank cursors over dp interleaved ranks
            self.rollout.stream.cursor = max(state["cursors"]) * state["dp"]
        self.rollout.stream.requeued = list(state.get("requeued", []))
        self.rollout.load_state_dict(state.get("rollout") or {})

    def _sample_records(self, batch: RolloutBatch, advantages: list[float]) -> list[dict[str, Any]]:
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
        out = os.path.join(dump_folder, "hf")
        self.policy.export_hf(self.args, self.tok, out, self.info.rank)
        return out

    def close(self) -> None:
        batch_invariant.disable()
        self.rollout.close()
        if self.server is not None:
            self.server.stop(grace_s=2.0)  # polling harnesses hear that the run is done

    def _serve(
        self, gen_model: Any, prompts: list[Any], n: int, seeds: list[int], greedy: bool = False
    ) -> tuple[list[Any], dict[str, float]]:
        """``env.kind = "http"``: the step's episodes, played by a harness over the endpoint."""
        from tandem.rl.serve.episodes import serve_episodes

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
            layout=self.gen_layout,
            version=self.step_index,
            beat=self.rt.watchdog.beat,
            stop=self.rt.stop_requested,
        )

    def _kv_ready(self) -> dict[str, float]:
        """Collective: FP8 KV scales exist before anything samples (the first calibration)."""
        return self.kv.ensure(self.policy, self.train_prompts, self.step_index) if self.kv else {}


def make_rl(cfg: Any, rt: Runtime) -> RLRecipe:
    """The RL recipe, or the one a rollout mode names (``recipe``: split mode's ranks)."""
    where = ROLLOUT_MODES.cap(cfg.rollout.mode, "recipe")
    if where:
        import importlib

        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)(cfg, rt)
    return RLRecipe(cfg, rt)
