"""Loss aggregation: per-token losses ``[N, T]`` to the scalar that is back-propagated.

Registry ``AGGREGATIONS``; every entry has the signature
``fn(loss [N, T], mask [N, T], norm: AggregationNorm) -> scalar``. Every mode weights a
token by a factor of its own sequence over a GLOBAL denominator (`make_norm`, counted over
the whole optimizer step), so the summed micro-batch losses equal the full batch's for any
split over micro-batches and ranks. The modes' formulas and the argument:
docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.rl.core.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "AggregationFn",
    "AggregationNorm",
    "aggregate",
    "entropy_loss",
    "make_norm",
    "masked_mean",
    "masked_sum",
]

AggregationFn = Callable[[Tensor, Tensor, "AggregationNorm"], Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


@dataclass(frozen=True)
class AggregationNorm:
    """Global denominators of one optimizer step (all micro-batches, all DP ranks).

    global_tokens: total masked tokens, 0-dim tensor or number.
    global_seqs: sequences with at least one masked token, 0-dim tensor or number.
    constant: the Dr. GRPO normaliser L (e.g. max response length); required only
        by ``seq_mean_token_sum_norm``.
    Tensors are kept on device so building and using a norm needs no host sync.
    """

    global_tokens: Tensor | float
    global_seqs: Tensor | float
    constant: float | None = None


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dims when None)."""
    xm = x * mask.to(x.dtype)
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries (0 where nothing is masked in)."""
    m = mask.to(x.dtype)
    total = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / total.clamp(min=1)


def _denominator(d: Tensor | float, like: Tensor) -> Tensor | float:
    """A denominator as ``like``'s dtype/device (numbers stay numbers); clamped at 1."""
    if isinstance(d, Tensor):
        return d.to(device=like.device, dtype=like.dtype).clamp(min=1)
    return max(float(d), 1.0)


def make_norm(
    masks: Tensor | Sequence[Tensor],
    constant: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> AggregationNorm:
    """Count the global denominators of an optimizer step.

    masks: this rank's micro-batch masks ``[N_k, T_k]`` (or one ``[N, T]`` mask).
    group: when given, the counts are all-reduced (summed) over it, e.g. the
        data-parallel group, so every rank holds the same denominators. This is
        one collective per step; no host sync.
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise ValueError("make_norm: no masks given")
    device = masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # [tokens, seqs]
    for m in masks:
        per_seq = m.to(torch.float64).sum(-1)  # [N_k]
        counts += torch.stack([per_seq.sum(), (per_seq > 0).to(torch.float64).sum()])
    if group is not None:
        dist.all_reduce(counts, group=group)
    return AggregationNorm(global_tokens=counts[0], global_seqs=counts[1], constant=constant)


@AGGREGATIONS.register("token_mean")
def token_mean(loss: Tensor, mask: Tensor, norm: AggregationNorm) -> Tensor:
    """sum(loss * mask) / global_tokens."""
    return masked_sum(loss, mask) / _denominator(norm.global_tokens, loss)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(loss: Tensor, mask: Tensor, norm: AggregationNorm) -> Tensor:
    """sum(loss * mask) / global_seqs: each sequence's token sum, averaged over sequences."""
    return masked_sum(loss, mask) / _denominator(norm.global_seqs, loss)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: AggregationNorm) -> Tensor:
    """sum_i mean_t(loss_i) / global_seqs; a sequence's length is local, so this splits exactly."""
    per_seq = masked_mean(loss, mask, dim=-1)  # [N]; 0 for empty sequences
    return per_seq.sum() / _denominator(norm.global_seqs, loss)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: AggregationNorm) -> Tensor:
    """sum(loss * mask) / (global_seqs * constant) (Dr. GRPO, arXiv 2503.20783)."""
    if norm.constant is None or norm.constant <= 0:
        raise ValueError(
            "seq_mean_token_sum_norm needs AggregationNorm.constant > 0 "
            "(e.g. the maximum response length)"
        )
    return masked_sum(loss, mask) / (_denominator(norm.global_seqs, loss) * float(norm.constant))


def aggregate(name: str, loss: Tensor, mask: Tensor, norm: AggregationNorm) -> Tensor:
    """Look up aggregation ``name`` and apply it."""
    return AGGREGATIONS.get(name)(loss, mask, norm)


def entropy_loss(
    entropy: Tensor, mask: Tensor, agg: str, norm: AggregationNorm, coef: float
) -> Tensor:
    """Entropy bonus as a loss term: ``-coef * aggregate(agg, entropy)``.

    entropy: ``[N, T]`` per-token entropy of the current policy (with grad).
    Aggregated with the same mode and global norm as the policy loss so that the
    bonus is layout-invariant too; add the result to the aggregated policy loss.
    """
    return -coef * aggregate(agg, entropy, mask, norm)
