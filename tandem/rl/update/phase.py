"""The RL update phase: one `RolloutBatch` in, ``rl.epochs * rl.minibatches`` optimizer steps.

Recompute what the loss needs in the update layout (the old log-probs when something
reads them before the loss, the reference's, the critic's values, the teachers'),
compute advantages with the registered estimator, then train every active learner
(`tandem.rl.update.learners`: the policy, a critic) minibatch by minibatch through one
`Updater`. Whether the old log-probs need their own forward is asked of capabilities
(`KL_MODES`' ``needs_old_logp``, the learners', the teachers'), never of names: with one
optimizer step per batch and nothing reading them early, the training forward's own
log-probs are the old ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.rl.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    KL_MODES,
    OFFPOLICY_CORRECTIONS,
    POLICY_LOSSES,
    AdvantageConfig,
    AdvantageInput,
    CorrectionInput,
    chunk_opd_advantages,
    chunk_reverse_kl,
    dense_group_index,
    m2po_keep,
    make_norm,
    overlong_penalty,
    proximal_logp,
)
from tandem.rl.core.system import peak_memory_gb, reset_peak_memory
from tandem.rl.rollout.types import RolloutBatch, RolloutSample
from tandem.rl.update.loss import (
    LossInputs,
    LossSpec,
    UpdateSums,
    completion_tensors,
    completion_versions,
    gap_metrics,
)


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    # per logged sample (the first ones): the mean advantage of its sampled tokens
    advantages: list[float] = field(default_factory=list)


class UpdatePhase:
    """Trains ``trainers`` (policy first) on rollout batches; ``rl`` and ``rollout`` are the
    config's sections, ``ref`` the frozen reference policy (None without a KL term),
    ``teachers`` the OPD teachers (None without distillation), ``kv`` the FP8 KV pool's
    scales (`tandem.rl.update.kv_scales.KVScales`, None without), calibrated after each update
    from the weights the next rollout runs."""

    def __init__(
        self,
        *,
        rl: Any,
        max_tokens: int,
        distill: Any,
        policy: Any,
        ref: Any,
        trainers: list[Any],
        updater: Any,
        teachers: Any,
        dp: tuple[int, Any],
        device: torch.device,
        samples_to_log: int,
        chunk_tokens: int,
        kv: Any = None,
    ) -> None:
        self.rl, self.max_tokens, self.distill = rl, max_tokens, distill
        self.policy, self.ref, self.trainers = policy, ref, trainers
        self.updater, self.teachers, self.kv = updater, teachers, kv
        self.dp, self.dp_group = dp
        self.device, self.samples_to_log = device, samples_to_log
        self.chunk_tokens = chunk_tokens  # advanced.logprob_chunk_tokens
        self.kl_in_loss = ref is not None and KL_MODES.cap(rl.kl_mode, "in_loss")
        corr = rl.offpolicy_correction
        early = (
            any(t.needs_old_logp for t in trainers)
            or (teachers is not None and teachers.needs_old_logp)
            or (ref is not None and KL_MODES.cap(rl.kl_mode, "needs_old_logp"))
            or OFFPOLICY_CORRECTIONS.cap(corr, "needs_old_logp", False)
        )
        # the old log-probs need a forward of their own when the batch feeds several optimizer
        # steps (the policy moves in between; a log-linear proximal policy does without) or
        # something reads them before the loss
        uses = OFFPOLICY_CORRECTIONS.cap(corr, "uses", ())
        loglinear = "proximal" in uses and rl.proximal == "loglinear"
        self.needs_old_logp = (rl.epochs * rl.minibatches > 1 and not loglinear) or early
        self.critic = next((t.critic for t in trainers if hasattr(t, "critic")), None)

    def run(self, batch: RolloutBatch, step: int) -> UpdateResult:
        r, dev, samples = self.rl, self.device, batch.samples
        t0 = time.monotonic()
        reset_peak_memory(dev)
        mask, gen_logp, width = completion_tensors(samples, dev)
        versions = completion_versions(samples, width, dev)
        if r.overlong_filter:
            trunc = torch.tensor([s.finish_reason == "length" for s in samples], device=dev)
            mask = mask * (~trunc).float()[:, None]
        self.policy.eval()
        self.policy.routing.arm(samples)  # MoE: the first forwards check the rollout's routing
        old_logp = self.policy.logprobs(samples, width) if self.needs_old_logp else None
        ref_logp = self.ref.logprobs(samples, width) if self.ref is not None else None
        values = None
        if self.critic is not None:  # tp = pp = 1 (checked at start): the policy's micro-batches
            mbs = self.policy.micro_batches(samples, list(range(len(samples))))
            values = self.critic.values(mbs, len(samples), width, dev)
        t_logprobs = time.monotonic() - t0  # old (reference, value) log-probs in the update layout
        adv, returns = self._advantages(samples, batch.scores, mask, old_logp, ref_logp, values)
        extra: dict[str, float] = {}
        if self.teachers is not None:
            adv, extra = self._distill(samples, mask, old_logp, adv, width)
        n_log = min(self.samples_to_log, len(samples))
        m_log = mask[:n_log]  # the sample log's advantage: the mean over the sampled tokens
        logged = ((adv[:n_log] * m_log).sum(-1) / m_log.sum(-1).clamp(min=1)).tolist()
        spec = LossSpec(
            policy_loss=POLICY_LOSSES.get(r.policy_loss),
            policy_cfg=r,
            aggregation=AGGREGATIONS.get(r.aggregation),
            kl_estimator=KL_ESTIMATORS.get(r.kl_estimator) if self.kl_in_loss else None,
            kl_coef=r.kl_coef,
            entropy_coef=r.entropy_coef,
            chunk_tokens=self.chunk_tokens,
            vocab_parallel=self.policy.vocab_parallel,
            correction=OFFPOLICY_CORRECTIONS.get(r.offpolicy_correction),
            correction_cfg=r.correction_config(),
        )
        inp = LossInputs(
            mask=mask,
            old_logp=old_logp,
            advantages=adv,
            gen_logp=gen_logp,
            ref_logp=ref_logp,
            values=values,
            returns=returns,
            seen_logp=torch.zeros_like(mask) if old_logp is None else None,
            versions=versions,
            version=batch.version,
        )
        if OFFPOLICY_CORRECTIONS.cap(r.offpolicy_correction, "batch_keep", False):
            inp.keep = self._m2po_keep(inp, spec)
        sums, norms = self._train(samples, inp, spec, width, step)
        sums = sums.all_reduce(
            self.policy.counts_stats, self.policy.group
        )  # one rank per replica reports
        tokens = max(sums.tokens.item(), 1.0)
        seen = old_logp if old_logp is not None else inp.seen_logp
        extra.update(
            gap_metrics(
                seen, gen_logp, mask, float(self.policy.counts_stats), group=self.policy.group
            )
        )
        if self.kv is not None:  # the next rollout's scales, from the weights it will run
            extra.update(self.kv.calibrate(self.policy, samples, step + 1))
        extra.update(self.policy.moe.metrics(self.dp_group, dev))
        extra.update(self.policy.routing.metrics(self.dp_group, dev))
        extra.update(self.policy.cp_metrics())
        if self.critic is not None:
            critic = norms.get("critic", [])
            mse = sums.value_sq_err.item() / max(sums.value_tokens.item(), 1.0)
            extra.update(
                {
                    "critic/value_mse": mse,
                    "critic/grad_norm": sum(critic) / max(len(critic), 1),
                    "critic/training_policy": float(self.trainers[0].active(step)),
                }
            )
        policy = norms.get("policy", [])
        extra.update(_offpolicy_metrics(sums, tokens))
        dt = time.monotonic() - t0
        return UpdateResult(
            {
                **extra,
                "loss": sums.loss.item() / max(sums.steps.item() / self.dp, 1.0),
                "clip_frac": sums.clipped.item() / tokens,
                "entropy": sums.entropy.item() / tokens,
                "kl": sums.kl.item() / tokens,
                "grad_norm": sum(policy) / max(len(policy), 1),
                "update/tokens": tokens,
                "update/tokens_per_s": tokens / dt,
                "time/update_s": dt,
                "time/logprobs_s": t_logprobs,
                "memory/update_peak_gb": peak_memory_gb(dev),
            },
            logged,
        )

    def _train(
        self, samples: list[RolloutSample], inp: LossInputs, spec: LossSpec, width: int, step: int
    ) -> tuple[UpdateSums, dict[str, list[float]]]:
        """The optimizer steps: every active trainer adds a minibatch, then one guarded update."""
        r = self.rl
        const = r.loss_constant or float(self.max_tokens)
        sums = UpdateSums.zeros(self.device)
        norms: dict[str, list[float]] = {}
        active = [t for t in self.trainers if t.active(step)]
        self.policy.train()
        for _ in range(r.epochs):
            for rows in self._minibatches(samples):
                norm = make_norm(inp.mask[rows], constant=const, group=self.dp_group)
                for t in active:
                    t.accumulate(samples, rows, inp, spec, norm, width, sums)
                loss = sums.loss + sums.value_sq_err
                stepped = self.updater.apply(loss, step, [t.learner for t in active])
                for name, gn in stepped.items():
                    norms.setdefault(name, []).append(gn)
                if "policy" in stepped:
                    sums.steps = sums.steps + 1
        return sums, norms

    def _advantages(
        self,
        samples: list[RolloutSample],
        scores: torch.Tensor,
        mask: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r, dev = self.rl, self.device
        scores = scores.to(dev)
        if r.overlong_buffer > 0:
            lengths = torch.tensor(
                [len(s.completion_ids) for s in samples], device=dev, dtype=torch.float32
            )
            scores = scores + overlong_penalty(
                lengths, self.max_tokens, r.overlong_buffer, r.overlong_penalty
            )
        token_rewards = None
        if ref_logp is not None and not self.kl_in_loss:  # the KL as a reward penalty
            kl_mode = KL_MODES.get(r.kl_mode)
            token_rewards = kl_mode(old_logp, ref_logp, mask, r.kl_coef, r.kl_estimator)
        groups = dense_group_index(torch.tensor([s.group for s in samples], device=dev))
        inp = AdvantageInput(
            scores=scores,
            mask=mask,
            group_index=groups,
            token_rewards=token_rewards,
            values=values,
            reduce_sum=self._dp_sum if self.dp_group is not None else None,
        )
        acfg = AdvantageConfig(norm_by_std=r.norm_by_std, gamma=r.gamma, lam=r.lam)
        out = ADVANTAGES.get(r.advantage)(inp, acfg)
        return out.advantages, out.returns

    def _m2po_keep(self, inp: LossInputs, spec: LossSpec) -> torch.Tensor:
        """M2PO's tokens, over the step's tokens on every rank (before any optimizer step: the
        proximal policy is the old one, the current one too)."""
        c = CorrectionInput(
            logp=inp.old_logp,
            prox_logp=inp.old_logp,
            behav_logp=inp.gen_logp,
            mask=inp.mask,
            versions=inp.versions,
            version=inp.version,
        )
        m2 = (proximal_logp(c, spec.correction_cfg.proximal) - inp.gen_logp) ** 2
        return m2po_keep(
            m2,
            inp.mask,
            spec.correction_cfg.m2_threshold,
            gather=self._dp_gather if self.dp_group is not None else None,
        )

    def _dp_gather(self, t: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor of every data-parallel rank (any lengths), concatenated in rank order."""
        parts: list[Any] = [None] * self.dp
        dist.all_gather_object(parts, t.cpu(), group=self.dp_group)
        return torch.cat(parts).to(t.device)

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (each holds other samples of the rollout batch)."""
        out = t.clone()
        dist.all_reduce(out, group=self.dp_group)
        return out

    def _distill(
        self,
        samples: list[RolloutSample],
        mask: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        width: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """OPD: advantages from the sampled reverse KL to each sample's teacher, chunk by chunk
        (a chunk is one token with the student's tokenizer), plus the reward's."""
        d = self.distill
        route = self.teachers.route(samples)
        t_chunk_logp, chunk_ids = self.teachers.score(
            samples, route, width, self.rl.micro_batch_tokens, self.device
        )
        out = d.coef * chunk_opd_advantages(old_logp, t_chunk_logp, chunk_ids, mask)
        if d.reward_weight:
            out = out + d.reward_weight * adv
        rkl = chunk_reverse_kl(old_logp, t_chunk_logp, chunk_ids)
        return out, self.teachers.metrics(rkl, chunk_ids, mask, route)

    def _minibatches(self, samples: list[RolloutSample]) -> list[list[int]]:
        """``rl.minibatches`` lists of sample rows: the step's groups over all ranks in stream
        order, cut into equal runs, so a minibatch holds the same groups on any layout."""
        k = self.rl.minibatches
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


def _offpolicy_metrics(sums: UpdateSums, tokens: float) -> dict[str, float]:
    """The behaviour / proximal / current mismatch over the step's trained tokens: the KLs (k3),
    the correction's mean weight, its effective sample size ``(sum w)^2 / (n sum w^2)`` (1: no
    correction at all) and the share of tokens it dropped."""
    w, w2 = sums.is_weight.item(), sums.is_weight_sq.item()
    return {
        "offpolicy/kl_behav_prox": sums.kl_behav.item() / tokens,
        "offpolicy/kl_prox_current": sums.kl_prox.item() / tokens,
        "offpolicy/weight_mean": w / tokens,
        "offpolicy/ess": w * w / max(tokens * w2, 1e-30),
        "offpolicy/dropped_frac": sums.dropped.item() / tokens,
    }
