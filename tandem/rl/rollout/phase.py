"""The RL rollout phase: prompts in, one scored `RolloutBatch` per step out.

`RolloutPhase` owns what sampling needs: the prompt stream (its position is the
run's data state), the generation copy of the policy, the reward pool, a reward
model and the environments. `batch(step)` is the synchronous rollout: gather the
policy into its generation layout, sample ``rl.num_samples`` completions for each of
the step's prompts, score them, optionally drop uninformative groups (DAPO) and
refill, and release the generation copy and KV pool before the update. Layout-
invariant: each round takes the next positions of the global prompt stream, deals
them over the data-parallel ranks, and keys every prompt's samples by (job seed,
step, stream position). The asynchronous modes reuse its generation and scoring
(tandem/rl/rollout/streaming.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.parallel.generation_layout import GenerationCopy
from tandem.parallel.offload import move_optimizer_state
from tandem.rl.algorithms import dense_group_index, filter_groups
from tandem.rl.core.fields import get_field
from tandem.rl.core.metrics import Tally
from tandem.rl.core.modeling import ModelSetupError
from tandem.rl.core.samples import dump_rollouts
from tandem.rl.core.system import allocated_gb, peak_memory_gb, reset_peak_memory
from tandem.rl.data.images import release_images
from tandem.rl.data.prompts import Prompt, PromptStream, deal, rollout_seed
from tandem.rl.rollout.inflight import DropBudget
from tandem.rl.rollout.sampling import sample_completions, sample_episodes
from tandem.rl.rollout.types import RolloutBatch, RolloutSample, response_tally


class RolloutPhase:
    """Sampling and scoring for the rl recipe; ``sections`` are the config's rl, rollout,
    reward, env and data sections (`tandem.rl.config.rl_schema`). ``kv``: the FP8 KV pool's
    scales (`tandem.rl.update.kv_scales.KVScales`, None without), made ready by ``kv_ready()``
    before anything samples; ``episodes``: plays the episodes in place of `generate`
    (``env.kind = "http"``: a harness over the endpoint, tandem/rl/generator/serve)."""

    def __init__(
        self,
        *,
        rl: Any,
        rollout: Any,
        reward: Any,
        env: Any,
        data: Any,
        seed: int,
        info: Any,
        tok: Any,
        train: list[Prompt],
        evals: list[Prompt],
        gen_copy: GenerationCopy,
        dp: tuple[int, int, Any],
        mp: tuple[int, int, Any],
        max_prompt: int,
        rollout_dumps: str | None,
        optimizer: torch.optim.Optimizer | None = None,
        kv: Any = None,
        kv_ready: Callable[[], dict[str, float]] | None = None,
        episodes: Callable[..., Any] | None = None,
    ) -> None:
        self.rl, self.rcfg, self.reward_cfg = rl, rollout, reward
        self.env_cfg, self.data_cfg = env, data
        self.seed, self.info, self.tok = seed, info, tok
        self.train_prompts, self.eval_prompts = train, evals
        self.gen_copy = gen_copy
        self.dp, self.dp_rank, self.dp_group = dp
        self.mp, self.mp_rank, self.mp_group = mp
        self.max_prompt, self.rollout_dumps = max_prompt, rollout_dumps
        self.optimizer = optimizer  # moved to CPU while the rollout runs (rl.offload_optimizer)
        self.kv, self.kv_ready, self.episodes = kv, kv_ready or dict, episodes
        self.stream = PromptStream(len(train), seed, data.shuffle)
        weights = reward.weights or [1.0] * len(reward.functions)
        self.reward_fns = list(zip(reward.functions, weights))
        from tandem.rl.workers.envd_client import env_pool, reward_pool

        self.rewards = reward_pool(reward)  # reward.modules were imported by config validation
        self.rm = self._reward_model() if reward.reward_model else None
        self.env_pool = None
        if env.name and gen_copy.layout.rank == 0:  # a generation group's leader steps the envs
            self.env_pool = env_pool(env)

    def _reward_model(self) -> Any:
        from tandem.rl.rollout.reward_model import RewardModelScorer

        path = self.reward_cfg.reward_model
        try:
            return RewardModelScorer(path, self.info.device)
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0]
            raise ModelSetupError(f"reward.reward_model ({path}): {first}") from None

    def _context(self, row: dict[str, Any]) -> Any:
        """The prompt of a data row as the reward model was trained on it (messages or text)."""
        d = self.data_cfg
        messages = get_field(row, d.messages_field)
        return messages if messages is not None else get_field(row, d.prompt_field)

    # ---- scoring ---------------------------------------------------------------------

    def score(self, samples: list[RolloutSample]) -> tuple[torch.Tensor, Tally]:
        """Each sample's total reward, and the reward metrics of this rank's samples; every
        sample's per-source rewards (functions, reward model, environment) go to
        ``s.info["rewards"]`` and the first source's score to ``s.info["accuracy"]``."""
        scores = torch.zeros(len(samples))
        tally = Tally()
        parts: dict[str, list[float]] = {}
        if self.reward_fns:
            res = self.rewards.score(
                self.reward_fns, [s.text for s in samples], [s.row for s in samples]
            )
            scores += torch.tensor(res.total, dtype=torch.float32)
            parts.update(
                {name: [float(v) for v in res.scores[name]] for name, _ in self.reward_fns}
            )
            for s, acc in zip(samples, parts[self.reward_fns[0][0]]):
                s.info["accuracy"] = acc
            tally = res.tally(total=False)  # the total here also counts the reward model and env
        n = len(samples)
        if self.rm is not None:  # scored here, on the rollout rank's device
            rm = torch.tensor(
                self.rm.score([self._context(s.row) for s in samples], [s.text for s in samples])
            )
            scores += self.reward_cfg.reward_model_weight * rm
            tally.mean("reward/reward_model/mean", rm.mean().item(), n)
            parts["reward_model"] = rm.tolist()
        env = [s.env_reward for s in samples]
        if any(v is not None for v in env):  # episodes' final rewards (none: the episode scores 0)
            env_t = torch.tensor([v or 0.0 for v in env], dtype=torch.float32)
            scores += env_t
            tally.mean("reward/env/mean", env_t.mean().item(), n)
            parts["env"] = env_t.tolist()
            if not self.reward_fns:
                for s, v in zip(samples, env_t.tolist()):
                    s.info["accuracy"] = float(v > 0)
        for i, s in enumerate(samples):
            s.info["rewards"] = {name: values[i] for name, values in parts.items()}
        tally.mean("reward/total", scores.mean().item() if n else 0.0, n)
        return scores, tally

    # ---- generation ------------------------------------------------------------------

    def generate(
        self, gen_model: Any, prompts: list[Prompt], n: int, seeds: list[int], greedy: bool = False
    ) -> tuple[list[RolloutSample], dict[str, float]]:
        """n completions per prompt: single-turn, multi-turn episodes when ``env.name`` is set, or
        a harness's (``episodes``); ``seeds`` one per prompt (its samples use seed + index)."""
        if self.episodes is not None:
            return self.episodes(gen_model, prompts, n, seeds, greedy)
        layout = self.gen_copy.layout
        kv = self.kv.for_heads(layout.tp, layout.rank) if self.kv is not None else None
        if self.env_cfg.name:
            return sample_episodes(
                gen_model,
                self.tok,
                prompts,
                n,
                self.rcfg,
                self.env_cfg,
                self.env_pool,
                seed=0,
                greedy=greedy,
                seeds=seeds,
                layout=layout,
                kv_scales=kv,
            )
        return sample_completions(
            gen_model,
            self.tok,
            prompts,
            n,
            self.rcfg,
            seed=0,
            max_prompt_tokens=self.max_prompt,
            greedy=greedy,
            seeds=seeds,
            layout=layout,
            kv_scales=kv,
        )

    def _generate_shared(
        self,
        gen_model: Any,
        prompts: list[Prompt],
        n: int,
        seeds: list[int],
    ) -> tuple[list[RolloutSample], torch.Tensor, dict[str, float], Tally]:
        """Generate and score, the prompts split over the model-parallel group (its TP and PP
        ranks share one data-parallel replica's batch), then gathered so that every rank of
        the group holds the same samples and scores. The reward tally is this rank's share."""
        mine = deal(prompts, self.mp_rank, self.mp)
        pooled = self.gen_copy.layout.tp > 1  # a generation group generates together: all take part
        new, gm = ([], {})
        if mine or pooled:
            new, gm = self.generate(gen_model, mine, n, deal(seeds, self.mp_rank, self.mp))
        sc, rm = self.score(new) if new else (torch.zeros(0), Tally())
        if self.mp == 1:
            return new, sc, gm, rm
        parts: list[Any] = [None] * self.mp
        dist.all_gather_object(parts, (new, sc.tolist()), group=self.mp_group)
        samples, scores = [], []
        for j, (part, part_sc) in enumerate(parts):
            for s in part:
                s.group = s.group * self.mp + j  # unique within the gathered batch
            samples += part
            scores += part_sc
        return samples, torch.tensor(scores, dtype=torch.float32), gm, rm

    def batch(self, step: int) -> RolloutBatch:
        """The synchronous rollout of ``step``: sample and score this step's prompts (refill
        rounds sized by the groups kept on all ranks together). A sample's ``group`` is its
        prompt's stream position; every sampled token has version ``step``."""
        r = self.rl
        t0 = time.monotonic()
        reset_peak_memory(self.info.device)
        before = allocated_gb(self.info.device)
        kv_metrics = self.kv_ready()  # collective: FP8 KV scales exist before anything samples
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu")
        gen_model, reshard = self.gen_copy.build()
        gen = Tally()
        for k, v in {**reshard, **kv_metrics}.items():
            gen.local(k, v)
        rewards = Tally()
        samples: list[RolloutSample] = []
        scores: list[torch.Tensor] = []
        kept, dropped, rounds = 0, 0, 0  # groups, over all ranks
        budget = DropBudget(r.max_refill_rounds * r.prompts_per_step)
        while kept < r.prompts_per_step:
            taken = self.stream.take(r.prompts_per_step - kept)
            mine = deal(taken, self.dp_rank, self.dp)
            seeds = [rollout_seed(self.seed, step, pos) for pos, _ in mine]
            prompts = [self.train_prompts[i] for _, i in mine]
            new, sc, gm, rm = self._generate_shared(gen_model, prompts, r.num_samples, seeds)
            for s in new:
                s.group = mine[s.group][0]
                s.versions = [step] * len(s.completion_ids)
            drop = self._dropped(taken, new, sc, budget) if r.dynamic_sampling else set()
            rounds += 1
            for s, v in zip(new, sc):
                if s.group not in drop:
                    samples.append(s)
                    scores.append(v)
            dropped += len(drop)
            kept += len(taken) - len(drop)
            rewards.merge(rm)
            for k, v in gm.items():  # this rank's generator: seconds and counts add up over rounds
                gen.local(k, v, add=k.endswith(("seconds", "tokens", "preemptions", "runs")))
            if not r.dynamic_sampling:
                break
        del gen_model
        if rounds > 1:  # refill rounds were each dealt from rank 0: deal as the streaming modes do
            samples, scores_t = self._redeal(samples, scores)
        else:
            scores_t = torch.stack(scores) if scores else torch.zeros(0)
        metrics = {**gen.values(), **rewards.reduce(device=self.info.device)}
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.info.device)
        if before is not None:  # the generation copy and KV pool are gone before the update
            metrics["memory/rollout_leftover_gb"] = allocated_gb(self.info.device) - before
        if self.kv is not None:
            metrics.update(self.kv.rollout_metrics(step))
        metrics.update(
            {
                "dynamic/dropped_groups": float(dropped),
                "dynamic/rounds": float(rounds),
                "time/rollout_s": time.monotonic() - t0,
                "memory/rollout_peak_gb": peak_memory_gb(self.info.device),
            }
        )
        if self.rollout_dumps:  # advanced.dump_rollouts
            dump_rollouts(self.rollout_dumps, step, self.info.rank, samples)
        return RolloutBatch(
            samples, scores_t, step, metrics, self.ids(samples), self.positions(samples)
        )

    def _redeal(
        self, samples: list[RolloutSample], scores: list[torch.Tensor]
    ) -> tuple[list[RolloutSample], torch.Tensor]:
        """This rank's kept groups of a step with refill rounds, dealt over the data-parallel
        ranks in stream order (`deal_in_stream_order`), as the streaming modes deal theirs."""
        groups: dict[int, tuple[list[RolloutSample], list[float]]] = {}
        for s, v in zip(samples, scores):
            g = groups.setdefault(s.group, ([], []))
            g[0].append(s)
            g[1].append(float(v))
        order: list[int] = sorted(groups)
        if self.dp > 1:  # every rank's positions
            parts: list[Any] = [None] * self.dp
            dist.all_gather_object(parts, order, group=self.dp_group)
            order = sorted(p for part in parts for p in part)
        mine = [(pos, g, sc) for pos, (g, sc) in groups.items()]
        return deal_in_stream_order(mine, order, self.dp, self.dp_rank, self.dp_group)

    def _dropped(
        self,
        taken: list[tuple[int, int]],
        new: list[RolloutSample],
        scores: torch.Tensor,
        budget: DropBudget,
    ) -> set[int]:
        """A refill round's groups ``taken`` (position, row) that `budget` drops: the ones whose
        rewards are all equal (DAPO's `filter_groups`), over every data-parallel rank."""
        groups = torch.tensor([s.group for s in new], dtype=torch.long)
        keep = filter_groups(scores, dense_group_index(groups)).tolist()
        index = {pos: i for i, (pos, _) in enumerate(taken)}
        flags = torch.zeros(len(taken), dtype=torch.float64, device=self.info.device)
        for s, k in zip(new, keep):  # 1: passes, 2: all rewards equal (this rank's groups)
            flags[index[s.group]] = 1.0 if k else 2.0
        if self.dp_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        drop, _ = budget.decide({pos: x != 2.0 for (pos, _), x in zip(taken, flags.tolist())})
        return drop

    def ids(self, samples: list[RolloutSample]) -> list[str]:
        """The prompt ids of ``samples`` for the ledger (one rank per model-parallel group)."""
        if self.mp_rank != 0:
            return []
        return sorted({str(s.row.get("id", s.row.get("problem_id", ""))) for s in samples})

    def positions(self, samples: list[RolloutSample]) -> list[int]:
        """Their prompt-stream positions (a sample's ``group``), for the ledger's exactly-once
        check (one rank per model-parallel group)."""
        return sorted({s.group for s in samples}) if self.mp_rank == 0 else []

    def sample_metrics(self, samples: list[RolloutSample]) -> dict[str, float]:
        """Response lengths, truncations and accuracy (`response_tally`) over the data-parallel
        ranks, which hold the step's samples (a model-parallel group's ranks hold the same ones:
        each such group reduces over its own data-parallel group to the same values)."""
        return response_tally(samples).reduce(group=self.dp_group, device=self.info.device)

    # ---- evaluation ------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: the first reward function's mean over ``rl.eval_samples`` completions
        per prompt sampled like the rollout (a fixed seed, so every evaluation sees the same noise),
        or over one greedy completion when ``rl.eval_samples = 0``."""
        if not self.eval_prompts:
            return {}
        self.kv_ready()
        gen_model, _ = self.gen_copy.build()
        order = list(range(len(self.eval_prompts)))
        mine = deal(order, self.info.rank, self.info.world_size)
        n = self.rl.eval_samples
        seeds = [rollout_seed(12345, -1, i) for i in mine]  # the same noise every time, any layout
        prompts = [self.eval_prompts[i] for i in mine]
        samples, _ = self.generate(gen_model, prompts, max(n, 1), seeds, greedy=n == 0)
        del gen_model
        self.score(samples)
        release_images(samples)
        acc = torch.tensor(
            [sum(s.info.get("accuracy", 0.0) for s in samples), len(samples)], dtype=torch.float64
        )
        dist.all_reduce(acc)
        return {"eval/accuracy": acc[0].item() / max(acc[1].item(), 1.0)}

    def state_dict(self) -> dict[str, Any]:
        """What is in flight between steps: nothing, in the synchronous rollout."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint of an asynchronous run: its groups in flight are sampled again here."""
        flights = (state or {}).get("admission", {}).get("flights", [])
        self.stream.requeue([f["position"] for f in flights])

    def close(self) -> None:
        self.rewards.close()
        if self.env_pool is not None:
            self.env_pool.close()


def deal_in_stream_order(
    mine: list[tuple[int, list[RolloutSample], list[float]]],
    order: list[int],
    dp: int,
    dp_rank: int,
    dp_group: Any,
) -> tuple[list[RolloutSample], torch.Tensor]:
    """Collective over ``dp_group``: the step's groups (``order``, stream positions) dealt over
    the data-parallel ranks in stream order (the i-th to rank i mod dp), from the (position,
    samples, scores) each rank holds in ``mine``: this rank's samples and scores."""
    target = {pos: i % dp for i, pos in enumerate(sorted(order))}
    keep = {pos: (g, sc) for pos, g, sc in mine if target[pos] == dp_rank}
    if dp > 1:
        send = [(pos, g, sc) for pos, g, sc in mine if target[pos] != dp_rank]
        parts: list[Any] = [None] * dp
        dist.all_gather_object(parts, send, group=dp_group)
        keep.update(
            {pos: (g, sc) for part in parts for pos, g, sc in part if target[pos] == dp_rank}
        )
    samples = [s for pos in sorted(keep) for s in keep[pos][0]]
    scores = [v for pos in sorted(keep) for v in keep[pos][1]]
    return samples, torch.tensor(scores, dtype=torch.float32)
