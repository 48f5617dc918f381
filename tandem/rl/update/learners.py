"""The models an RL update trains, as a list: the policy and, for PPO, its critic.

Each trainer holds a `Learner` (its modules, optimizer, clip and schedule, which the
NaN/Inf rule steps) and adds its part of a minibatch: forward, backward and its sums
(`UpdateSums`). The update phase steps every trainer that is ``active`` at a step (the
policy waits while the critic warms up) through one `Updater.apply`, so a skipped update
drops every trainer's gradients together and nothing is passed around as callbacks.
A trainer that reads the policy's log-probs from before the update (a separate forward)
says so with ``needs_old_logp``.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.rl.core.optim import Learner
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.critic import Critic
from tandem.rl.update.loss import LossInputs, LossSpec, UpdateSums


class PolicyTrainer:
    """The policy (`tandem.rl.update.policy`): its loss over a minibatch's rows."""

    # one optimizer step per batch: the training forward's own log-probs are the old ones
    needs_old_logp = False

    def __init__(
        self,
        policy: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        max_grad_norm: float,
        warmup_steps: int = 0,
    ) -> None:
        self.policy, self.warmup_steps = policy, warmup_steps
        self.learner = Learner(
            "policy", policy.modules, optimizer, policy.clip, max_grad_norm, scheduler
        )

    def active(self, step: int) -> bool:
        """The policy trains once the critic's warm-up steps are over."""
        return step >= self.warmup_steps

    def accumulate(
        self,
        samples: list[RolloutSample],
        rows: list[int],
        inp: LossInputs,
        spec: LossSpec,
        norm: Any,
        width: int,
        sums: UpdateSums,
    ) -> None:
        sums += self.policy.accumulate(samples, rows, inp, spec, norm, width)


class CriticTrainer:
    """PPO's value model: the clipped value loss over the policy's micro-batches of the rows."""

    # During the critic's warm-up steps the policy takes no forward, so the train/generation
    # gap is measured on a separate pass of the policy before the update.
    needs_old_logp = True

    def __init__(self, critic: Critic, policy: Any, *, max_grad_norm: float, dp: int) -> None:
        self.critic, self.policy, self.dp = critic, policy, dp
        self.learner = Learner(
            "critic",
            [critic.model],
            critic.opt,
            lambda max_norm: critic.clip(max_norm),
            max_grad_norm,
        )

    def active(self, step: int) -> bool:
        return True

    def accumulate(
        self,
        samples: list[RolloutSample],
        rows: list[int],
        inp: LossInputs,
        spec: LossSpec,
        norm: Any,
        width: int,
        sums: UpdateSums,
    ) -> None:
        assert inp.values is not None and inp.returns is not None
        for mb in self.policy.micro_batches(samples, rows):  # tp = pp = 1 (checked at start)
            vloss, sq = self.critic.micro_batch_loss(
                mb, inp.values, inp.returns, inp.mask, norm, width
            )
            (vloss * self.dp * self.policy.cp.size).backward()  # FSDP2: the dp x cp mean
            sums.add_value(sq, inp.mask[mb.rows].sum() if mb.rows else 0.0)
