"""Policy-gradient losses: per-token surrogate losses ``[N, T]``, not yet aggregated.

Registry ``POLICY_LOSSES``; every entry has the signature
``fn(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput``.
The caller reduces ``loss`` with an aggregation from `tandem.rl.algorithms.aggregation`
(the choice of aggregation is separate from the choice of loss).

Metrics are per-token ``[N, T]`` tensors (zero outside the mask) so the caller can
reduce them with the same mask and global norm as the loss, layout-invariantly:
- ``clipped``: 1 where the clip (or dual clip) removed the token's gradient;
- ``ratio``: the importance ratio used by the loss (sequence ratio for GSPO);
- ``approx_kl``: k3 estimate of KL(pi_old || pi_theta) per token,
  ``(r - 1) - log r`` with ``r = pi_theta / pi_old`` on tokens sampled from pi_old.

The behaviour policy (the generator's log-probs: another layout, possibly older
weights) enters through an off-policy correction (`tandem.rl.algorithms.offpolicy`),
which chooses ``old_logp`` and weights the per-token loss.

Log-ratios are clamped to [-20, 20] before ``exp`` so one far-off token cannot
overflow; the clamp is inactive for any ratio the clip range lets through.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.rl.core.configlib import require
from tandem.rl.core.registry import Registry

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossInput",
    "PolicyLossOutput",
]

_MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLossInput:
    logp: Tensor  # [N, T] current policy, with grad
    old_logp: Tensor  # [N, T] policy before this update, recomputed in the update layout
    advantages: Tensor  # [N, T]
    mask: Tensor  # [N, T] float/bool


@dataclass
class PolicyLossConfig:
    """The policy losses' clip settings, defined and checked
    here once. The ``[rl]`` config section extends this class (tandem/rl/config/rl_schema.py
    `RLConfig`), so they are set as ``rl.<key>``; a loss declares the clip keys it reads
    (``uses``)."""

    clip_low: float = 0.2  # ppo_clip: token ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ppo_clip: ... and above at 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip: float | None = None  # ppo_clip: c > 1 bounds the loss of a token with advantage A <
    # 0 by -c x A (arXiv 1912.09729 uses 3); none = off
    seq_clip_low: float = 3e-4  # gspo: sequence ratio clipped below at 1 - seq_clip_low
    seq_clip_high: float = 4e-4  # gspo: ... and above at 1 + seq_clip_high

    def __post_init__(self) -> None:
        PolicyLossConfig.validate(self)

    def validate(self) -> None:
        require(
            0 <= self.clip_low < 1 and self.clip_high >= 0,
            f"rl.clip_low / rl.clip_high: need 0 <= clip_low < 1 and clip_high >= 0, "
            f"got {self.clip_low} / {self.clip_high}",
        )
        require(
            0 <= self.seq_clip_low < 1 and self.seq_clip_high >= 0,
            f"rl.seq_clip_low / rl.seq_clip_high: need 0 <= seq_clip_low < 1 and "
            f"seq_clip_high >= 0, got {self.seq_clip_low} / {self.seq_clip_high}",
        )
        require(
            self.dual_clip is None or self.dual_clip > 1,
            f"rl.dual_clip: must be > 1, got {self.dual_clip}",
        )


@dataclass
class PolicyLossOutput:
    loss: Tensor  # [N, T] per-token loss, zero outside the mask
    metrics: dict[str, Tensor] = field(default_factory=dict)  # per-token [N, T] (or scalars)


PolicyLossFn = Callable[[PolicyLossInput, PolicyLossConfig], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def _log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _approx_kl(log_ratio: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) per token from log(new/old) on old's samples."""
    lr = log_ratio.detach()
    return torch.expm1(lr) - lr


def _finish(
    loss: Tensor, inp: PolicyLossInput, cfg: PolicyLossConfig, metrics: dict[str, Tensor]
) -> PolicyLossOutput:
    """Mask the loss and the per-token metrics."""
    keep = inp.mask.bool()
    # torch.where, not "* mask": padding log-probs may be non-finite and inf * 0 is nan
    metrics = {
        k: torch.where(keep, v.detach(), 0.0) if v.dim() == 2 else v.detach()
        for k, v in metrics.items()
    }
    return PolicyLossOutput(torch.where(keep, loss, 0.0), metrics)


@POLICY_LOSSES.register("ppo_clip", uses=("clip_low", "clip_high", "dual_clip"))
def ppo_clip(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """PPO clipped surrogate (arXiv 1707.06347) with asymmetric clip and optional dual clip.

    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi_theta / pi_old.
    Asymmetric bounds are DAPO's clip-higher (arXiv 2503.14476). With dual clip
    (arXiv 1912.09729) the loss of a negative-advantage token is further bounded
    by ``c * |A|``, so a huge ratio on a bad token cannot dominate the update.
    """
    a = inp.advantages.detach()
    log_ratio = _log_ratio(inp.logp, inp.old_logp.detach())  # [N, T]
    ratio = log_ratio.exp()
    loss1 = -a * ratio
    loss2 = -a * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if cfg.dual_clip is not None:
        bound = -a * cfg.dual_clip  # > 0 where a < 0
        dual = (a < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    metrics = {
        "clipped": clipped.to(loss.dtype),
        "ratio": ratio,
        "approx_kl": _approx_kl(log_ratio),
    }
    return _finish(loss, inp, cfg, metrics)


@POLICY_LOSSES.register("gspo", uses=("seq_clip_low", "seq_clip_high"))
def gspo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """GSPO (arXiv 2507.18071, "Group Sequence Policy Optimization"), token-level form.

    s_i = exp(mean_t over the sequence's masked tokens of (logp - old_logp)), the
    length-normalised sequence ratio; each token uses
    s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)] (GSPO-token), whose value
    is s_i and whose gradient is s_i * grad log pi_theta(y_t), and
    loss_t = max(-A s_it, -A clip(s_it, 1 - seq_clip_low, 1 + seq_clip_high)).
    With sequence-level advantages and ``seq_mean_token_mean`` aggregation this
    equals the paper's sequence objective. ``dual_clip`` is not used.
    """
    a = inp.advantages.detach()
    keep = inp.mask.bool()
    log_ratio = _log_ratio(inp.logp, inp.old_logp.detach())  # [N, T]
    lengths = keep.sum(-1).clamp(min=1)  # [N]
    seq_log_ratio = torch.where(keep, log_ratio, 0.0).sum(-1) / lengths  # [N]
    seq_ratio = seq_log_ratio.detach().exp()[:, None]  # [N, 1], sg[s_i]
    s = seq_ratio * (inp.logp - inp.logp.detach()).exp()  # [N, T], value s_i
    loss1 = -a * s
    loss2 = -a * s.clamp(1 - cfg.seq_clip_low, 1 + cfg.seq_clip_high)
    loss = torch.maximum(loss1, loss2)
    metrics = {
        "clipped": (loss2 > loss1).to(loss.dtype),
        "ratio": seq_ratio.expand_as(loss),
        "approx_kl": _approx_kl(log_ratio),
    }
    return _finish(loss, inp, cfg, metrics)


@POLICY_LOSSES.register("reinforce", uses=())
def reinforce(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """REINFORCE (Williams 1992): loss_t = -A_t log pi_theta(y_t); on-policy, no ratio, no clip.

    The ratio and KL metrics are still reported (they are 1 and 0 when
    old_logp is the same policy), so drift from on-policy is visible.
    """
    a = inp.advantages.detach()
    log_ratio = _log_ratio(inp.logp.detach(), inp.old_logp.detach())
    loss = -a * inp.logp
    metrics = {
        "clipped": torch.zeros_like(loss),
        "ratio": log_ratio.exp(),
        "approx_kl": _approx_kl(log_ratio),
    }
    return _finish(loss, inp, cfg, metrics)
