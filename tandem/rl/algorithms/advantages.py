"""Advantage estimators: rewards (and a critic, for GAE) to per-token advantages.

Registry ``ADVANTAGES``; every entry has the signature
``fn(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput``.

Shapes: N responses, T response-token positions (right-padded), mask ``[N, T]``
(1 = a token the policy sampled and that enters the loss; tool-output tokens in a
multi-turn response may be 0 in the middle of a row).

Conventions shared by the estimators:
- ``group_index`` holds dense group ids in ``[0, N)`` (e.g. the slot of the prompt
  in the batch), so group statistics use scatter ops into a size-N buffer with no
  host sync. `dense_group_index` maps arbitrary ids (prompt uids) to such ids.
- Critic-free estimators (grpo, dr_grpo, rloo) work on a sequence-level reward
  ``score_i + sum_t token_rewards_it`` (the undiscounted return, so a KL-as-reward
  penalty is honoured), and broadcast the sequence advantage over the mask.
  They ignore ``values``; ``returns`` is None.
- Token-level estimators (reinforce_pp, gae) place the score at the last masked
  token; masked-out positions in the middle of a row are skipped by the
  recursions (they carry the running return/value through unchanged).
- The group std is the unbiased (Bessel) std; a group of one gets advantage 0.
- Everything is computed in float32 (or the input's wider dtype) and the
  advantages are zero outside the mask.
- Global statistics (REINFORCE++ normalisation, GAE whitening) are over the
  whole rollout batch: the tokens passed in, plus those of the other ranks when
  ``AdvantageInput.reduce_sum`` all-reduces over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.rl.core.registry import Registry

__all__ = [
    "ADVANTAGES",
    "AdvantageConfig",
    "AdvantageFn",
    "AdvantageInput",
    "AdvantageOutput",
    "dense_group_index",
    "discounted_returns",
    "group_stats",
    "last_token_mask",
    "masked_whiten",
]


@dataclass
class AdvantageInput:
    scores: Tensor  # [N] sequence-level reward
    mask: Tensor  # [N, T] float/bool
    group_index: Tensor | None = None  # [N] long, dense ids in [0, N); needed by group estimators
    token_rewards: Tensor | None = None  # [N, T] added to the reward (e.g. -beta * KL)
    values: Tensor | None = None  # [N, T] critic values (gae)
    # Sums a tensor over every rank holding other samples of the same rollout batch (an
    # all-reduce over the data-parallel group); batch-wide statistics (REINFORCE++ and GAE
    # whitening) go through it, so advantages do not depend on how the batch is split.
    # None: this call holds the whole batch.
    reduce_sum: Callable[[Tensor], Tensor] | None = None


@dataclass
class AdvantageConfig:
    norm_by_std: bool = True  # grpo: divide by the group std; reinforce_pp: by the batch std
    eps: float = 1e-6  # added to every std before dividing
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda
    whiten: bool = True  # gae: whiten advantages over the masked tokens of the batch

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"advantage eps must be > 0, got {self.eps}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"advantage gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"advantage lam must be in [0, 1], got {self.lam}")


@dataclass
class AdvantageOutput:
    advantages: Tensor  # [N, T], zero outside the mask
    # [N, T] value targets (gae) or token returns (reinforce_pp); None otherwise
    returns: Tensor | None


AdvantageFn = Callable[[AdvantageInput, AdvantageConfig], AdvantageOutput]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


# ---------------------------------------------------------------------------
# helpers


def _float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def dense_group_index(ids: Tensor) -> Tensor:
    """Map arbitrary group ids ``[N]`` to dense ids in ``[0, G)``.

    Host sync: ``torch.unique`` has a data-dependent output size. Call it once
    where the batch is assembled, not inside the loss.
    """
    return torch.unique(ids, return_inverse=True)[1]


def group_stats(x: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element (mean, unbiased std, count) of the element's group.

    x: ``[N]`` float; group_index: ``[N]`` long with ids in ``[0, N)``.
    Returns three ``[N]`` tensors, gathered back to the elements. No host sync.
    """
    n = x.shape[0]
    g = group_index.long()
    zeros = torch.zeros(n, dtype=x.dtype, device=x.device)
    count = zeros.scatter_add(0, g, torch.ones_like(x))[g]  # [N], >= 1
    mean = zeros.scatter_add(0, g, x)[g] / count  # [N]
    sq = zeros.scatter_add(0, g, (x - mean) ** 2)[g]  # [N]
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # [N]; 0 for groups of one
    return mean, std, count


def last_token_mask(mask: Tensor) -> Tensor:
    """``[N, T]`` one-hot of each row's last masked position (all zero for empty rows)."""
    m = _float(mask)
    pos = torch.arange(1, m.shape[-1] + 1, device=m.device, dtype=m.dtype)  # [T]
    last = (m * pos).argmax(-1, keepdim=True)  # [N, 1]
    return torch.zeros_like(m).scatter(-1, last, 1.0) * m


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{next masked t'}, over masked positions only; ``[N, T]``.

    gamma == 1 is a reversed cumulative sum; otherwise a loop over T (elementwise
    ops, no host sync).
    """
    m = _float(mask)
    r = rewards * m
    if gamma == 1.0:
        return r.flip(-1).cumsum(-1).flip(-1) * m
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])  # [N]
    for t in range(r.shape[-1] - 1, -1, -1):
        g = r[:, t] + gamma * running
        running = m[:, t] * g + (1 - m[:, t]) * running
        out[:, t] = g
    return out * m


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    eps: float,
    scale: bool = True,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries (unbiased std); zero outside the mask.

    With ``reduce_sum`` the mean and std are those of the masked entries of every
    rank's part (two all-reduces: the sums and count, then the squared deviations)."""
    m = _float(mask)
    total = torch.stack([(x * m).sum(), m.sum()])  # [2]: sum, count
    if reduce_sum is not None:
        total = reduce_sum(total)
    mean = total[0] / total[1].clamp(min=1)
    out = (x - mean) * m
    if scale:
        sq = (out**2).sum()
        if reduce_sum is not None:
            sq = reduce_sum(sq)
        var = sq / (total[1] - 1).clamp(min=1)
        out = out / (var.sqrt() + eps)
    return out


def _sequence_rewards(inp: AdvantageInput) -> Tensor:
    """score_i + sum_t token_rewards_it over the mask; ``[N]``."""
    r = _float(inp.scores)
    if inp.token_rewards is not None:
        r = r + (inp.token_rewards * _float(inp.mask)).sum(-1)
    return r


def _need_groups(inp: AdvantageInput, name: str) -> Tensor:
    if inp.group_index is None:
        raise ValueError(f"advantage estimator {name!r} needs AdvantageInput.group_index")
    return inp.group_index


def _broadcast(adv_seq: Tensor, mask: Tensor) -> Tensor:
    return adv_seq[:, None] * _float(mask)  # [N] -> [N, T]


# ---------------------------------------------------------------------------
# critic-free, sequence-level


@ADVANTAGES.register("grpo", group_relative=True)
def grpo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """GRPO outcome advantage (DeepSeekMath, arXiv 2402.03300): (r - group mean) / group std.

    Departure: the std gets ``+ eps`` and is skipped when ``cfg.norm_by_std`` is
    False (which is then the same as dr_grpo).
    """
    r = _sequence_rewards(inp)  # [N]
    mean, std, _ = group_stats(r, _need_groups(inp, "grpo"))
    adv = r - mean
    if cfg.norm_by_std:
        adv = adv / (std + cfg.eps)
    return AdvantageOutput(_broadcast(adv, inp.mask), None)


@ADVANTAGES.register("dr_grpo", group_relative=True)
def dr_grpo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """Dr. GRPO (arXiv 2503.20783, "Understanding R1-Zero-Like Training"): r - group mean.

    No std division, whatever ``cfg.norm_by_std`` says: the paper removes it as a
    question-difficulty bias. Pair with ``seq_mean_token_sum_norm`` aggregation.
    """
    r = _sequence_rewards(inp)
    mean, _, _ = group_stats(r, _need_groups(inp, "dr_grpo"))
    return AdvantageOutput(_broadcast(r - mean, inp.mask), None)


@ADVANTAGES.register("rloo", group_relative=True)
def rloo(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """RLOO (arXiv 2402.14740, "Back to Basics"): r_i - mean of the other rewards in the group.

    Equals k/(k-1) * (r_i - group mean) for a group of k; a group of one gets 0.
    ``cfg.norm_by_std`` is not used (the paper does not normalise).
    """
    r = _sequence_rewards(inp)
    mean, _, count = group_stats(r, _need_groups(inp, "rloo"))
    others = (mean * count - r) / (count - 1).clamp(min=1)  # [N]
    adv = torch.where(count > 1, r - others, torch.zeros_like(r))
    return AdvantageOutput(_broadcast(adv, inp.mask), None)


# ---------------------------------------------------------------------------
# token-level


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (arXiv 2501.03262): token return, normalised over the whole batch.

    Per-token reward = token_rewards (e.g. -beta * KL) plus the score at the last
    masked token; G_t = sum_{k >= t} gamma^(k-t) r_k; the advantage is G
    normalised by the mean and (when ``cfg.norm_by_std``) std over all masked
    tokens of the batch. ``returns`` holds the unnormalised G.
    """
    m = _float(inp.mask)
    r = last_token_mask(m) * _float(inp.scores)[:, None]  # [N, T]
    if inp.token_rewards is not None:
        r = r + inp.token_rewards * m
    ret = discounted_returns(r, m, cfg.gamma)  # [N, T]
    adv = masked_whiten(ret, m, cfg.eps, scale=cfg.norm_by_std, reduce_sum=inp.reduce_sum)
    return AdvantageOutput(adv, ret)


@ADVANTAGES.register("gae", needs_values=True)
def gae(inp: AdvantageInput, cfg: AdvantageConfig) -> AdvantageOutput:
    """PPO with Generalized Advantage Estimation (arXiv 1506.02438; PPO arXiv 1707.06347).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1},
    where t+1 is the next masked position (V and A are 0 past the last one) and
    r_t = token_rewards_t plus the score at the last masked token.
    returns = A + V (before whitening) are the value-loss targets; the advantages
    are whitened over the masked tokens when ``cfg.whiten``.
    """
    if inp.values is None:
        raise ValueError("advantage estimator 'gae' needs AdvantageInput.values (a critic)")
    m = _float(inp.mask)
    v = _float(inp.values).detach() * m  # [N, T]
    r = last_token_mask(m) * _float(inp.scores)[:, None]
    if inp.token_rewards is not None:
        r = r + inp.token_rewards * m
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])  # [N]
    next_a = torch.zeros_like(r[:, 0])  # [N]
    for t in range(r.shape[-1] - 1, -1, -1):
        mt = m[:, t]
        a = r[:, t] + cfg.gamma * next_v - v[:, t] + cfg.gamma * cfg.lam * next_a
        next_a = mt * a + (1 - mt) * next_a
        next_v = mt * v[:, t] + (1 - mt) * next_v
        adv[:, t] = a
    adv = adv * m
    returns = (adv + v) * m
    if cfg.whiten:
        adv = masked_whiten(adv, m, cfg.eps, reduce_sum=inp.reduce_sum)
    return AdvantageOutput(adv, returns)
