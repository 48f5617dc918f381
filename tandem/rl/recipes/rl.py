"""The RL recipe: each step a rollout phase, then an update phase, on the same ranks.

rollout: gather the sharded policy into a generation copy, sample n completions
per prompt with the in-house generator, score them in CPU reward workers,
optionally drop uninformative groups (DAPO) and refill; the generation copy
and KV pool are released. update: recompute old (and reference) log-probs in
the update layout, compute advantages and the registered policy loss, and take
``rl.minibatches * rl.epochs`` optimizer steps. Algorithm pieces are registry
names from the config, and what the loop must build for one (a critic, a
reference model) is asked of the registry's capabilities, never of a name.
Resume, checkpoints, preemption, logging and evaluation cadence are the
shell's (tandem/rl/recipes/loop.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.kernels import batch_invariant
from tandem.parallel.mesh import subgroup
from tandem.parallel.offload import move_optimizer_state
from tandem.rl.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageConfig,
    AdvantageInput,
    chunk_opd_advantages,
    chunk_reverse_kl,
    dense_group_index,
    filter_groups,
    kl_penalty_rewards,
    make_norm,
    overlong_penalty,
)
from tandem.rl.core.fields import get_field
from tandem.rl.data.prompts import (
    PromptStream,
    deal,
    encode_prompts,
    load_prompt_rows,
    prompt_messages,
    rollout_seed,
)
from tandem.rl.recipes.base import CheckpointParts, Runtime, StepOutput, Updater, setup
from tandem.rl.recipes.rl_settings import check_rl_settings, episode_server
from tandem.rl.rollout.sampling import (
    generation_copy,
    generation_dtype,
    sample_completions,
    sample_episodes,
)
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.modeling import BuildSpec, ModelSetupError
from tandem.rl.core.optim import build_optimizer, build_scheduler
from tandem.rl.core.samples import SampleLog, dump_rollouts
from tandem.rl.core.system import allocated_gb, peak_memory_gb, reset_peak_memory
from tandem.rl.update.critic import Critic
from tandem.rl.update.kv_scales import KVScales
from tandem.rl.update.lora_reference import frozen_reference
from tandem.rl.update.loss import (
    LossInputs,
    LossSpec,
    completion_tensors,
)
from tandem.rl.update.policy import build_policy, check_layout
from tandem.rl.update.teachers import Teachers
from tandem.rl.workers.reward_pool import RewardPool

_COUNTS = ("errors", "timeouts", "crashes")  # reward metrics that are counts (summed, not averaged)


class RLRecipe:
    console_keys = ("reward/total", "accuracy", "response/length_mean", "kl", "entropy", "clip_frac", "grad_norm",
                    "gap/abs_mean", "time/rollout_s", "time/update_s")

    def __init__(self, cfg: Any, rt: Runtime) -> None:
        self.cfg, self.info, self.rt = cfg, rt.info, rt
        info = rt.info
        r, advanced = cfg.rl, cfg.advanced
        needs_values = ADVANTAGES.cap(r.advantage, "needs_values", False)
        self.http = cfg.env.kind == "http"  # a harness plays the episodes (tandem/rl/serve)
        check_rl_settings(cfg, info, needs_values)
        s = setup(cfg, rt, "rl", batch=("rl.prompts_per_step", r.prompts_per_step), fsdp_only=False)
        degrees = s.degrees
        self.mp = degrees.tp * degrees.pp * degrees.cp  # ranks sharing one replica's samples
        if r.exact:  # process-wide, like torch.use_deterministic_algorithms: both phases run in it
            batch_invariant.enable()
        self.mesh, self.dp, self.dp_rank = s.mesh, s.dp, s.rank_dp
        self.tok, self.args = s.tokenizer, s.args
        self.dp_group = subgroup(self.mesh, ("dp_replicate", "dp_shard"))
        self.mp_group = mp = subgroup(self.mesh, ("pp", "cp", "tp"))
        self.mp_rank = dist.get_rank(mp) if mp is not None else 0
        dump = rt.dump_folder
        check_layout(self.args, degrees, cfg.parallel.pp_schedule, cfg.parallel.cp_style, cfg.parallel.ep)
        self.max_prompt = cfg.data.max_length - cfg.rollout.max_tokens
        if self.max_prompt < 1:
            raise ConfigError(f"data.max_length: {cfg.data.max_length} leaves no room for prompts after rollout.max_tokens {cfg.rollout.max_tokens}")
        self.train_prompts, self.eval_prompts = self._load_data()
        episodic = cfg.env.name or self.http
        seq_len = self.max_prompt + cfg.env.max_total_tokens if episodic else cfg.data.max_length
        spec = BuildSpec.from_config(cfg.training, cfg.parallel)
        kw = dict(path=cfg.model.path, seed=cfg.job.seed, spec=spec, is_main=info.is_main,
                  pp_schedule=cfg.parallel.pp_schedule, pp_microbatches=advanced.pp_microbatches,
                  seq_len=seq_len, micro_batch_tokens=r.micro_batch_tokens,
                  chunk_tokens=advanced.logprob_chunk_tokens,
                  share_prompts=degrees.pp == 1 if advanced.share_prompts is None
                  else advanced.share_prompts, cp_style=cfg.parallel.cp_style)
        self.policy = build_policy(self.args, self.mesh, info.device, lora=cfg.lora, **kw)  # [lora]: adapters
        self.model = self.policy.state_module  # the full model's parameter names (checkpoints)
        self.gen_dtype = generation_dtype(cfg.rollout.dtype, info.device, cfg.training.mixed_precision_param)
        self.gen_copy = generation_copy(
            self.policy, self.args, cfg.rollout, info, self.gen_dtype,
            offload_optimizer=r.offload_optimizer, reference=r.kl_coef > 0 and not cfg.lora.enabled,
            critic=needs_values, bucket_bytes=advanced.reshard_bucket_mb << 20)
        self.ref = frozen_reference(self.policy, lambda: build_policy(  # LoRA: the policy, adapters off
            self.args, self.mesh, info.device, trainable=False, **kw)) if r.kl_coef > 0 else None
        self.kv = KVScales.create(cfg.rollout, self.args, self.policy, self.ref)  # FP8 KV or None
        o = cfg.optimizer
        self.opt = build_optimizer(self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.critic = Critic(cfg.critic, o, self.args, self.mesh, info.device, spec, policy_path=cfg.model.path,
                             seed=cfg.job.seed, is_main=info.is_main, cp=self.policy.split) if needs_values else None
        self.critic_warmup, self.teachers = cfg.critic.warmup_steps if self.critic is not None else 0, None
        if cfg.distill.teachers:
            self.teachers = Teachers(cfg.distill, self.tok, self.mesh, info.device, spec, seed=cfg.job.seed,
                                     is_main=info.is_main, conversation=self._conversation)
            if self.teachers.cross_tokenizer and cfg.env.name:
                raise ConfigError("distill.teachers: a teacher with another tokenizer scores single-turn completions "
                                  "only so far; env.name (multi-turn episodes) needs teachers with the student's tokenizer")
            self.teachers.check_rows([p.row for p in self.train_prompts + self.eval_prompts])  # fail now, not mid-run
        self.rm, self.env_pool = self._reward_model() if cfg.reward.reward_model else None, None
        if cfg.env.name and self.gen_copy.layout.rank == 0:  # a generation group's leader steps its environments
            from tandem.rl.workers.env_pool import EnvPool

            self.env_pool = EnvPool(cfg.env.num_workers, step_timeout_s=cfg.env.step_timeout_s)
        self.server = episode_server(cfg, info, self.tok)  # env.kind = "http": the endpoint, or None
        # the policy's optimizer steps (its lr schedule) exclude the critic warm-up steps
        self.total_updates = max(cfg.training.steps - self.critic_warmup, 1) * r.epochs * r.minibatches
        self.sched = build_scheduler(self.opt, total_steps=self.total_updates,
                                     warmup_steps=cfg.lr_schedule.warmup_steps * r.epochs * r.minibatches,
                                     decay=cfg.lr_schedule.decay, min_lr_ratio=cfg.lr_schedule.min_lr_ratio)
        self.updater = Updater(self.opt, self.sched, self.policy.modules, self.policy.clip,
                               max_grad_norm=o.max_grad_norm, fault=cfg.fault, dump_folder=dump, rank=info.rank)
        weights = cfg.reward.weights or [1.0] * len(cfg.reward.functions)
        self.reward_fns = list(zip(cfg.reward.functions, weights))
        self.rewards = RewardPool(  # reward.modules were imported by config validation
            cfg.reward.num_workers if cfg.reward.functions else 0, cfg.reward.timeout_s, rewards=cfg.reward.functions,
            reward_kwargs=cfg.reward.kwargs, memory_mb=cfg.reward.memory_mb or None)
        self.stream = PromptStream(len(self.train_prompts), cfg.job.seed, cfg.data.shuffle)
        self.step_index = 0  # the step being taken (the shell's count)
        self.sample_log = SampleLog(dump, cfg.metrics.samples_per_step, info.is_main, text_sink=rt.logger.text)
        self._advantage_of: list[float] = []  # per sample, the mean advantage of its sampled tokens (last update)

    # ---- data ------------------------------------------------------------------------

    def _load_data(self):
        d = self.cfg.data
        kw = dict(prompt_field=d.prompt_field, messages_field=d.messages_field, answer_field=d.answer_field,
                  max_prompt_tokens=self.max_prompt, on_bad_row=d.on_bad_row)
        rows = load_prompt_rows(d.path, d.format, split="train", seed=self.cfg.job.seed, n_synthetic=d.synthetic_rows)
        train, skipped = encode_prompts(rows, self.tok, source=d.path, **kw)
        eval_path = d.eval_path or (d.path if d.path.startswith("synthetic:") else None)
        evals = []
        if eval_path:
            erows = load_prompt_rows(eval_path, d.format, split="test", seed=self.cfg.job.seed + 1,
                                     n_synthetic=self.cfg.rl.eval_prompts)
            evals, _ = encode_prompts(erows[: self.cfg.rl.eval_prompts], self.tok, source=eval_path, **kw)
        if self.info.is_main:
            print(f"data: {len(train)} train prompts, {len(evals)} eval prompts; skipped {sum(skipped.values())} {skipped}", flush=True)
        return train, evals

    # ---- rollout ---------------------------------------------------------------------

    def _reward_model(self):
        from tandem.rl.rollout.reward_model import RewardModelScorer

        path = self.cfg.reward.reward_model
        try:
            return RewardModelScorer(path, self.info.device)
        except (OSError, ValueError, KeyError) as e:
            raise ModelSetupError(f"reward.reward_model ({path}): {str(e).strip().splitlines()[0]}") from None

    def _context(self, row: dict[str, Any]) -> Any:
        """The prompt of a data row as the reward model was trained on it (messages or text)."""
        d = self.cfg.data
        messages = get_field(row, d.messages_field)
        return messages if messages is not None else get_field(row, d.prompt_field)

    def _conversation(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat turns a row's prompt was rendered from (what another tokenizer's teacher renders)."""
        return prompt_messages(row, self.cfg.data.prompt_field, self.cfg.data.messages_field)

    def _score(self, samples: list[RolloutSample]) -> tuple[torch.Tensor, dict[str, float]]:
        """Each sample's total reward, and the step's reward metrics; every sample's per-source
        rewards (reward functions, reward model, environment) go to ``s.info["rewards"]``."""
        scores = torch.zeros(len(samples))
        metrics: dict[str, float] = {}
        parts: dict[str, list[float]] = {}
        if self.reward_fns:
            res = self.rewards.score(self.reward_fns, [s.text for s in samples], [s.row for s in samples])
            scores += torch.tensor(res.total, dtype=torch.float32)
            parts.update({name: [float(v) for v in res.scores[name]] for name, _ in self.reward_fns})
            for s, acc in zip(samples, parts[self.reward_fns[0][0]]):
                s.info["accuracy"] = acc
            metrics = res.metrics()
        if self.rm is not None:  # scored here, on the rollout rank's device
            rm = torch.tensor(self.rm.score([self._context(s.row) for s in samples], [s.text for s in samples]))
            scores += self.cfg.reward.reward_model_weight * rm
            metrics["reward/reward_model/mean"] = rm.mean().item()
            parts["reward_model"] = rm.tolist()
        env = [s.env_reward for s in samples]
        if any(v is not None for v in env):  # episodes' final rewards (an episode without one scores 0)
            env_t = torch.tensor([v or 0.0 for v in env], dtype=torch.float32)
            scores += env_t
            metrics["reward/env/mean"] = env_t.mean().item()
            parts["env"] = env_t.tolist()
            if not self.reward_fns:
                for s, v in zip(samples, env_t.tolist()):
                    s.info["accuracy"] = float(v > 0)
        for i, s in enumerate(samples):
            s.info["rewards"] = {name: values[i] for name, values in parts.items()}
        metrics["reward/total"] = scores.mean().item()
        return scores, metrics

    def _generate(self, gen_model, prompts, n: int, seeds: list[int], greedy: bool = False):
        """n completions per prompt: single-turn, or multi-turn episodes when ``env.name`` is set;
        ``seeds`` one per prompt (its samples use seed + sample index)."""
        layout = self.gen_copy.layout
        kv = self.kv.for_heads(layout.tp, layout.rank) if self.kv is not None else None
        if self.http:
            from tandem.rl.serve.episodes import serve_episodes

            return serve_episodes(self.server, gen_model, self.tok, prompts, n, self.cfg.rollout,
                                  self.cfg.env, seeds=seeds, greedy=greedy,
                                  layout=self.gen_copy.layout, version=self.step_index,
                                  beat=self.rt.watchdog.beat)
        if self.cfg.env.name:
            return sample_episodes(gen_model, self.tok, prompts, n, self.cfg.rollout, self.cfg.env,
                                   self.env_pool, seed=0, greedy=greedy, seeds=seeds, layout=layout,
                                   kv_scales=kv)
        return sample_completions(gen_model, self.tok, prompts, n, self.cfg.rollout, seed=0,
                                  max_prompt_tokens=self.max_prompt, greedy=greedy, seeds=seeds,
                                  layout=layout, kv_scales=kv)

    def _generate_shared(self, gen_model, prompts, n: int, seeds: list[int]):
        """Generate and score, the prompts split over the model-parallel group (its TP and PP
        ranks share one data-parallel replica's batch), then gathered so that every rank of
        the group holds the same samples, scores and reward metrics."""
        mine = deal(prompts, self.mp_rank, self.mp)
        pooled = self.gen_copy.layout.tp > 1  # a generation group generates together: every rank takes part
        new, gm = (self._generate(gen_model, mine, n, deal(seeds, self.mp_rank, self.mp)) if mine or pooled
                   else ([], {}))
        sc, rm = self._score(new) if new else (torch.zeros(0), {})
        if self.mp == 1:
            return new, sc, gm, rm
        parts: list[Any] = [None] * self.mp
        dist.all_gather_object(parts, (new, sc.tolist(), rm), group=self.mp_group)
        samples, scores, counts, merged = [], [], [], {}
        for j, (part, part_sc, part_rm) in enumerate(parts):
            for s in part:
                s.group = s.group * self.mp + j  # unique within the gathered batch
            samples += part
            scores += part_sc
            counts.append((len(part), part_rm))
        total = max(sum(c for c, _ in counts), 1)
        for c, part_rm in counts:
            for k, v in part_rm.items():
                add = v if k.endswith(_COUNTS) else v * c / total
                merged[k] = merged.get(k, 0.0) + add
        return samples, torch.tensor(scores, dtype=torch.float32), gm, merged

    def rollout(self) -> tuple[list[RolloutSample], torch.Tensor, dict[str, float]]:
        """Sample and score this step's prompts. Layout-invariant: each round takes the next
        positions of the global prompt stream, deals them over the data-parallel ranks, and keys
        every prompt's samples by (job seed, step, stream position); refill rounds are sized by
        the groups kept on all ranks together. A sample's ``group`` is its prompt's position."""
        cfg, r = self.cfg, self.cfg.rl
        t0 = time.monotonic()
        reset_peak_memory(self.info.device)
        before = allocated_gb(self.info.device)
        kv_metrics = self._kv_ready()  # collective: FP8 KV scales exist before anything samples
        if r.offload_optimizer:
            move_optimizer_state(self.opt, "cpu")
        gen_model, metrics = self.gen_copy.build()
        metrics.update(kv_metrics)
        samples: list[RolloutSample] = []
        scores: list[torch.Tensor] = []
        kept, dropped, rounds = 0, 0, 0  # groups, over all ranks
        while kept < r.prompts_per_step:
            taken = self.stream.take(r.prompts_per_step - kept)
            mine = deal(taken, self.dp_rank, self.dp)
            seeds = [rollout_seed(cfg.job.seed, self.step_index, pos) for pos, _ in mine]
            new, sc, gm, rm = self._generate_shared(gen_model, [self.train_prompts[i] for _, i in mine], r.num_samples,
                                                    seeds)
            for s in new:
                s.group = mine[s.group][0]
            groups = torch.tensor([s.group for s in new], dtype=torch.long)
            keep = filter_groups(sc, dense_group_index(groups)) if r.dynamic_sampling else torch.ones(len(new), dtype=torch.bool)
            rounds += 1
            last_round = rounds > r.max_refill_rounds
            if last_round:  # keep what we have rather than stall
                keep[:] = True
            for s, k, v in zip(new, keep.tolist(), sc):
                if k:
                    samples.append(s)
                    scores.append(v)
            n_keep = self._dp_count(len({s.group for s, k in zip(new, keep.tolist()) if k}))
            dropped += len(taken) - n_keep
            kept += n_keep
            for k, v in {**gm, **rm}.items():
                metrics[k] = metrics.get(k, 0.0) + v if k.endswith(("seconds", "tokens", "preemptions", *_COUNTS)) else v
            if last_round or not r.dynamic_sampling:
                break
        del gen_model
        self._reduce_reward_metrics(metrics)
        if r.offload_optimizer:
            move_optimizer_state(self.opt, self.info.device)
        if before is not None:  # the generation copy and KV pool are gone: the update starts where it would have
            metrics["memory/rollout_leftover_gb"] = allocated_gb(self.info.device) - before
        if self.kv is not None:
            metrics.update(self.kv.rollout_metrics(self.step_index))
        metrics.update({"dynamic/dropped_groups": float(dropped), "dynamic/rounds": float(rounds),
                        "time/rollout_s": time.monotonic() - t0, "memory/rollout_peak_gb": peak_memory_gb(self.info.device)})
        if self.cfg.advanced.dump_rollouts:
            dump_rollouts(self.rt.dump_folder, self.step_index, self.info.rank, samples)
        return samples, torch.stack(scores) if scores else torch.zeros(0), metrics

    def _dp_count(self, n: int) -> int:
        """``n`` summed over the data-parallel ranks (a model-parallel group holds the same samples)."""
        if self.dp_group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.info.device)
        dist.all_reduce(t, group=self.dp_group)
        return int(t.item())

    def _minibatches(self, samples: list[RolloutSample]) -> list[list[int]]:
        """``rl.minibatches`` lists of sample rows: the step's groups over all ranks in stream
        order, cut into equal runs, so a minibatch holds the same groups on any layout."""
        k = self.cfg.rl.minibatches
        if k == 1:
            return [list(range(len(samples)))]
        mine = sorted({s.group for s in samples})
        everyone: list[Any] = [mine]
        if self.dp_group is not None:
            everyone = [None] * self.dp
            dist.all_gather_object(everyone, mine, group=self.dp_group)
        order = sorted(g for part in everyone for g in part)
        which = {g: i * k // len(order) for i, g in enumerate(order)}
        return [[i for i, s in enumerate(samples) if which[s.group] == j] for j in range(k)]

    def _reduce_reward_metrics(self, metrics: dict[str, float]) -> None:
        """Reward means over all ranks (failure counts summed), so the log is not rank 0's alone."""
        keys = sorted(k for k in metrics if k.startswith("reward/"))
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t)
        for k, v in zip(keys, t.tolist()):  # a model-parallel group holds identical (merged) values
            metrics[k] = v / self.mp if k.endswith(_COUNTS) else v / self.info.world_size

    # ---- update ----------------------------------------------------------------------

    def _advantages(self, samples, scores, mask, old_logp, ref_logp, values) -> tuple[torch.Tensor, torch.Tensor | None]:
        r, dev = self.cfg.rl, self.info.device
        scores = scores.to(dev)
        if r.overlong_buffer > 0:
            lengths = torch.tensor([len(s.completion_ids) for s in samples], device=dev, dtype=torch.float32)
            scores = scores + overlong_penalty(lengths, self.cfg.rollout.max_tokens, r.overlong_buffer, r.overlong_penalty)
        token_rewards = None
        if ref_logp is not None and r.kl_mode == "reward":
            token_rewards = kl_penalty_rewards(old_logp, ref_logp, mask, r.kl_coef, r.kl_estimator)
        groups = dense_group_index(torch.tensor([s.group for s in samples], device=dev))
        inp = AdvantageInput(scores=scores, mask=mask, group_index=groups, token_rewards=token_rewards, values=values,
                             reduce_sum=self._dp_sum if self.dp_group is not None else None)
        acfg = AdvantageConfig(norm_by_std=r.norm_by_std, gamma=r.gamma, lam=r.lam)
        out = ADVANTAGES.get(r.advantage)(inp, acfg)
        return out.advantages, out.returns

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (each holds other samples of the rollout batch)."""
        out = t.clone()
        dist.all_reduce(out, group=self.dp_group)
        return out

    def _distill(self, samples, mask, old_logp, adv, width) -> tuple[torch.Tensor, dict[str, float]]:
        """OPD: advantages from the sampled reverse KL to each sample's teacher, chunk by chunk
        (a chunk is one token with the student's tokenizer), plus the reward's."""
        d, dev = self.cfg.distill, self.info.device
        route = self.teachers.route(samples)
        t_chunk_logp, chunk_ids = self.teachers.score(samples, route, width, self.cfg.rl.micro_batch_tokens, dev)
        out = d.coef * chunk_opd_advantages(old_logp, t_chunk_logp, chunk_ids, mask)
        if d.reward_weight:
            out = out + d.reward_weight * adv
        return out, self.teachers.metrics(chunk_reverse_kl(old_logp, t_chunk_logp, chunk_ids), chunk_ids, mask, route)

    def update(self, samples: list[RolloutSample], scores: torch.Tensor) -> dict[str, float]:
        cfg, r, dev = self.cfg, self.cfg.rl, self.info.device
        t0 = time.monotonic()
        reset_peak_memory(dev)
        mask, gen_logp, width = completion_tensors(samples, dev)
        if r.overlong_filter:
            trunc = torch.tensor([s.finish_reason == "length" for s in samples], device=dev)
            mask = mask * (~trunc).float()[:, None]
        self.policy.eval()
        # One optimizer step per rollout and nothing that reads the old policy
        # before the loss: skip the extra forward (see LossInputs.old_logp).
        one_step = (r.epochs == 1 and r.minibatches == 1 and self.teachers is None and self.critic is None
                    and not (self.ref is not None and r.kl_mode == "reward"))
        self.policy.routing.arm(samples)  # MoE: the update's first forwards check the rollout's routing
        old_logp = None if one_step else self.policy.logprobs(samples, width)
        ref_logp = self.ref.logprobs(samples, width) if self.ref is not None else None
        values = None
        if self.critic is not None:  # tp = pp = 1 (checked at start): the policy's micro-batches
            values = self.critic.values(self.policy.micro_batches(samples, list(range(len(samples)))), len(samples),
                                        width, dev)
        t_logprobs = time.monotonic() - t0  # old (and reference, value) log-probs in the update layout
        adv, returns = self._advantages(samples, scores, mask, old_logp, ref_logp, values)
        extra: dict[str, float] = {}
        if self.teachers is not None:
            adv, extra = self._distill(samples, mask, old_logp, adv, width)
        n_log = min(self.cfg.metrics.samples_per_step, len(samples)) if self.info.is_main else 0
        m_log = mask[:n_log]  # the sample log's advantage: the mean over the sampled (trained) tokens
        self._advantage_of = ((adv[:n_log] * m_log).sum(-1) / m_log.sum(-1).clamp(min=1)).tolist()
        train_policy = self.step_index >= self.critic_warmup
        spec = LossSpec(policy_loss=POLICY_LOSSES.get(r.policy_loss), policy_cfg=r,
                        aggregation=AGGREGATIONS.get(r.aggregation),
                        kl_estimator=KL_ESTIMATORS.get(r.kl_estimator) if ref_logp is not None and r.kl_mode == "loss" else None,
                        kl_coef=r.kl_coef, entropy_coef=r.entropy_coef,
                        chunk_tokens=self.cfg.advanced.logprob_chunk_tokens,
                        vocab_parallel=self.policy.vocab_parallel)
        inp = LossInputs(mask=mask, old_logp=old_logp, advantages=adv, gen_logp=gen_logp, ref_logp=ref_logp,
                         seen_logp=torch.zeros_like(mask) if old_logp is None else None)
        const = r.loss_constant or float(cfg.rollout.max_tokens)
        sums = torch.zeros(8, dtype=torch.float64, device=dev)  # loss, clipped, entropy, kl, tokens, steps, value sq err, value tokens
        grad_norms, critic_norms = [], []
        self.policy.train()
        for _ in range(r.epochs):
            for mb_rows in self._minibatches(samples):
                norm = make_norm(mask[mb_rows], constant=const, group=self.dp_group)
                also = None
                if self.critic is not None:
                    def also(mb, norm=norm):
                        vloss, sq = self.critic.micro_batch_loss(mb, values, returns, mask, norm, width)
                        (vloss * self.dp * self.policy.cp.size).backward()  # FSDP2: dp x cp mean
                        sums[6] += sq.double()
                        sums[7] += mask[mb.rows].sum().double() if mb.rows else 0.0
                sums[:5] += self.policy.accumulate(samples, mb_rows, inp, spec, norm, width, policy=train_policy,
                                                   also=also)
                critic = self.critic
                gn = self.updater.apply(sums[0] + sums[6], self.step_index, optimizer=train_policy,
                                        on_apply=(lambda c=critic: critic_norms.append(c.step())) if critic else None,
                                        on_skip=critic.zero_grad if critic else None)
                if gn is not None:
                    grad_norms.append(gn)
                    sums[5] += 1
        if not self.policy.counts_stats:  # one rank per data-parallel replica reports (the last stage's tp rank 0)
            sums.zero_()
        dist.all_reduce(sums)
        tokens = max(sums[4].item(), 1.0)
        extra.update(self._gap_metrics(old_logp if old_logp is not None else inp.seen_logp, gen_logp, mask))
        if self.kv is not None:  # the next rollout's scales, from the weights it will run
            extra.update(self.kv.calibrate(self.policy, samples, self.step_index + 1))
        extra.update(self.policy.moe.metrics(self.dp_group, dev))
        extra.update(self.policy.routing.metrics(self.dp_group, dev))
        extra.update(self.policy.cp_metrics())
        if self.critic is not None:
            extra.update({"critic/value_mse": sums[6].item() / max(sums[7].item(), 1.0),
                          "critic/grad_norm": sum(critic_norms) / max(len(critic_norms), 1),
                          "critic/training_policy": float(train_policy)})
        return {**extra, "loss": sums[0].item() / max(sums[5].item() / self.dp, 1.0),
                "clip_frac": sums[1].item() / tokens, "entropy": sums[2].item() / tokens, "kl": sums[3].item() / tokens,
                "grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "lr": self.sched.get_last_lr()[0],
                "update/tokens": tokens, "update/tokens_per_s": tokens / (time.monotonic() - t0),
                "time/update_s": time.monotonic() - t0, "time/logprobs_s": t_logprobs,
                "memory/update_peak_gb": peak_memory_gb(dev)}

    def _gap_metrics(self, update_logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """How far the rollout's sampled-token log-probs are from the update's recomputation
        with the same weights, over all ranks (one rank per data-parallel replica counts)."""
        gap = (update_logp - gen_logp).abs() * mask * float(self.policy.counts_stats)
        stats = torch.stack([gap.sum(), mask.sum(), (gap > 0).sum(),
                             gap.max() if gap.numel() else gap.new_zeros(())]).double()
        gmax = stats[3:].clone()
        dist.all_reduce(stats[:3])
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX)
        return {"gap/abs_mean": stats[0].item() / max(stats[1].item(), 1.0), "gap/abs_max": gmax.item(),
                "gap/tokens_differ": stats[2].item()}

    # ---- evaluation ------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: the first reward function's mean over ``rl.eval_samples`` completions
        per prompt sampled like the rollout (a fixed seed, so every evaluation sees the same noise),
        or over one greedy completion when ``rl.eval_samples = 0``."""
        if not self.eval_prompts:
            return {}
        self._kv_ready()
        gen_model, _ = self.gen_copy.build()
        order = list(range(len(self.eval_prompts)))
        mine = deal(order, self.info.rank, self.info.world_size)
        n = self.cfg.rl.eval_samples
        seeds = [rollout_seed(12345, -1, i) for i in mine]  # the same noise at every evaluation, on any layout
        samples, _ = self._generate(gen_model, [self.eval_prompts[i] for i in mine], max(n, 1), seeds, greedy=n == 0)
        del gen_model
        self._score(samples)
        acc = torch.tensor([sum(s.info.get("accuracy", 0.0) for s in samples), len(samples)], dtype=torch.float64)
        dist.all_reduce(acc)
        return {"eval/accuracy": acc[0].item() / max(acc[1].item(), 1.0)}

    # ---- the recipe protocol (tandem/rl/recipes/base.py) -------------------------------------

    def checkpoint_parts(self) -> CheckpointParts:
        extras = self.critic.checkpoint_extras() if self.critic is not None else {}
        return CheckpointParts(self.model, self.opt, extras)

    def state_dict(self) -> dict[str, Any]:
        kv = {"kv_scales": self.kv.state_dict()} if self.kv else {}  # the same on every rank
        return {"scheduler": self.sched.state_dict(), "cursor": self.stream.cursor, **kv}

    def load_state_dict(self, state: dict[str, Any], *, saved_world: int) -> None:
        """The prompt stream's position is global, so any world size continues where the saved
        run stopped (and samples what it would have: seeds are keyed by position, not rank)."""
        self.sched.load_state_dict(state["scheduler"])
        if self.kv is not None and "kv_scales" in state:
            self.kv.load_state_dict(state["kv_scales"])
        if "cursor" in state:
            self.stream.cursor = state["cursor"]
        else:  # a checkpoint from before the global stream: per-rank cursors over dp interleaved ranks
            self.stream.cursor = max(state["cursors"]) * state["dp"]

    def step(self, step: int) -> StepOutput:
        wd = self.rt.watchdog
        self.step_index = step
        with wd.phase("rollout"):
            samples, scores, metrics = self.rollout()
        with wd.phase("update"):
            metrics.update(self.update(samples, scores))
        metrics.update(self._rollout_metrics(samples))
        self.sample_log.log(step + 1, self._sample_records(samples, scores))
        ids = sorted({str(s.row.get("id", s.row.get("problem_id", ""))) for s in samples}) if self.mp_rank == 0 else []
        return StepOutput(metrics, ids)

    def _sample_records(self, samples: list[RolloutSample], scores: torch.Tensor) -> list[dict[str, Any]]:
        """The first ``metrics.samples_per_step`` samples of this rank as samples.jsonl records
        (rank 0 writes its own: the first prompts' groups, whose advantages are relative to each other)."""
        n = min(self.cfg.metrics.samples_per_step, len(samples)) if self.info.is_main else 0
        return [{"prompt": self.tok.decode(s.prompt_ids), "completion": s.text, "reward": float(scores[i]),
                 "rewards": s.info.get("rewards", {}), "advantage": self._advantage_of[i] if self._advantage_of else None,
                 "finish_reason": s.finish_reason, "completion_tokens": len(s.completion_ids),
                 "id": str(s.row.get("id", s.row.get("problem_id", "")))} for i, s in enumerate(samples[:n])]

    def export(self, dump_folder: str) -> str:
        out = os.path.join(dump_folder, "hf")
        self.policy.export_hf(self.args, self.tok, out, self.info.rank)
        return out

    def close(self) -> None:
        batch_invariant.disable()
        self.rewards.close()
        if self.env_pool is not None:
            self.env_pool.close()
        if self.server is not None:
            self.server.stop(grace_s=2.0)  # polling harnesses hear that the run is done

    def _kv_ready(self) -> dict[str, float]:
        return self.kv.ensure(self.policy, self.train_prompts, self.step_index) if self.kv else {}

    def _rollout_metrics(self, samples: list[RolloutSample]) -> dict[str, float]:
        t = torch.tensor([[len(s.completion_ids), s.finish_reason == "length", s.info.get("accuracy", 0.0)] for s in samples],
                         dtype=torch.float64)
        stats = torch.stack([t[:, 0].sum(), t[:, 1].sum(), t[:, 2].sum(), torch.tensor(float(len(samples)), dtype=torch.float64)])
        mx = t[:, 0].max().reshape(1)
        dist.all_reduce(stats)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        n = max(stats[3].item(), 1.0)
        return {"response/length_mean": stats[0].item() / n, "response/length_max": mx.item(),
                "response/clipped_frac": stats[1].item() / n, "accuracy": stats[2].item() / n}


def make_rl(cfg: Any, rt: Runtime) -> RLRecipe:
    return RLRecipe(cfg, rt)
