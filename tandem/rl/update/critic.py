"""The PPO critic: a value model beside the policy, on the same mesh, updated in the same phase.

The critic is `tandem.models.value_head.ScalarHeadModel` (the policy architecture
with a scalar head), started from ``critic.path`` (an HF folder: a policy or
a reward model) or, by default, from the policy's own starting weights with a
fresh head. It is sharded with FSDP2 over the policy's data-parallel mesh and
has its own AdamW and learning rate.

Values are read at the positions whose logits give the completion tokens'
log-probs (the state before each token), so ``values[i, t]`` is V(s_t) for
completion token t and lines up with the policy's [N, T] tensors. Each update
phase: `values` (no grad, before any optimizer step) feeds GAE; then every
micro-batch adds the clipped value loss (tandem/rl/algorithms/value.py) against the
GAE returns; the critic steps when the policy does (tandem/rl/update/learners.py).
During the first ``critic.warmup_steps`` RL steps only the critic learns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tandem.models.args import ModelArgs
from tandem.parallel.grad import clip_grad_norm
from tandem.rl.algorithms import AGGREGATIONS
from tandem.rl.algorithms.value import value_loss
from tandem.rl.config.rl_schema import CriticConfig
from tandem.rl.config.schema import OptimizerConfig
from tandem.rl.core.modeling import BuildSpec, build_scalar_model
from tandem.rl.core.optim import build_optimizer
from tandem.rl.update.cp_batch import cp_values
from tandem.rl.update.loss import scatter_completions
from tandem.rl.update.packing import MicroBatch


class Critic:
    def __init__(
        self,
        c: CriticConfig,
        o: OptimizerConfig,
        args: ModelArgs,
        mesh: Any,
        device: torch.device,
        spec: BuildSpec,
        *,
        policy_path: str | None,
        seed: int,
        is_main: bool,
        cp: Any = None,
    ) -> None:
        self.cfg, self.cp = c, cp  # cp: the policy's split (a ContextParallel) or None
        self.model = build_scalar_model(
            args, c.path or policy_path, seed + 17, mesh, device, spec, is_main=is_main
        )
        self.opt = build_optimizer(
            self.model, lr=c.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.aggregation = AGGREGATIONS.get("token_mean")

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """V(s_t) at the completion tokens, ``mb.comp_*`` order [K] (cp: every rank's, summed)."""
        if self.cp is not None:
            return cp_values(self.model, mb, self.cp)
        attn = mb.attention(wrapped=False)  # not the policy's FP8 K/V rounding
        v = self.model(mb.tokens, positions=mb.positions, attn=attn).reshape(-1)  # [B*S]
        return v.index_select(0, mb.comp_index)

    @torch.no_grad()
    def values(
        self, mbs: list[MicroBatch], n: int, width: int, device: torch.device
    ) -> torch.Tensor:
        """V(s_t) of every completion token [N, width], before this phase's updates."""
        self.model.eval()
        out = torch.zeros(n, width, device=device)
        for mb in mbs:
            v = self._values(mb)
            if mb.rows:
                out[mb.rows] = scatter_completions(v, mb, width)
        self.model.train()
        return out

    def micro_batch_loss(
        self,
        mb: MicroBatch,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        norm: Any,
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aggregated clipped value loss of one micro-batch, its sum of squared errors)."""
        v_l = self._values(mb)
        if not mb.rows:
            return v_l.sum() * 0.0, v_l.new_zeros(())
        rows = mb.rows
        v = scatter_completions(v_l, mb, width)
        m = mask[rows]
        tok = value_loss(v, old_values[rows], returns[rows], m, self.cfg.value_clip)
        loss = self.cfg.coef * self.aggregation(tok, m, norm)
        return loss, ((v.detach() - returns[rows]) ** 2 * m).sum()

    def clip(self, max_norm: float) -> float:
        """Clip the critic's gradients to ``max_norm``; the norm before clipping."""
        return clip_grad_norm(self.model.parameters(), max_norm)

    def checkpoint_extras(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return {"critic": (self.model, self.opt)}
