"""Off-policy corrections: the samples' behaviour policy is not the policy being trained.

Three policies meet in an update: the **behaviour** policy that sampled each token (the
generator's log-probs, possibly several versions old in asynchronous RL, and computed
by an inference layout in any case), the **proximal** policy (the policy before this
update, recomputed in the update layout, or approximated), and the **current** policy
(with grad). Registry ``OFFPOLICY_CORRECTIONS`` (``rl.offpolicy_correction``); every
entry has the signature ``fn(inp: CorrectionInput, cfg: CorrectionConfig) ->
CorrectionOutput``: the log-probs the policy loss's ratio divides by (``old_logp``) and a
detached per-token weight multiplying the policy loss (0 drops a token). With
``rho = exp(prox - behav)`` per token (``token`` level) or ``exp(sum of the sequence's
log-ratios)`` for every token of it (``sequence`` level):

- ``none``: weight 1;
- ``tis``: truncated importance sampling, ``min(rho, C)`` (Yao et al., "Your efficient
  RL framework secretly brings you off-policy RL training", 2025);
- ``mis``: masked importance sampling, ``rho`` where ``rho <= C``, else 0 (Liu et al.,
  "When speed kills stability", 2025);
- ``decoupled``: AReaL's decoupled PPO (arXiv 2505.24298): the clip is taken against the
  proximal policy, weighted by ``min(rho, C)`` (no cap: ``rho``); the proximal policy is
  recomputed, or (``rl.proximal = "loglinear"``) interpolated in log space between the
  behaviour and the current policy by versions: ``alpha = (v - v_b) / (v + 1 - v_b)``
  for a token of version ``v_b`` trained at version ``v``, ``prox = behav + alpha
  (current - behav)`` (AReaL's approximation: no forward for it even with several
  optimizer steps per batch);
- ``m2po``: decoupled PPO whose tokens with the largest second moment ``(prox -
  behav)^2`` are dropped until the mean of the rest is below ``rl.m2_threshold``
  (M2PO, arXiv 2510.01161), the weight ``rho`` uncapped; the cut is taken over the
  step's tokens on all ranks (`m2po_keep`), so it needs the proximal log-probs before
  the update (``needs_old_logp``).

Capabilities: ``uses`` (the ``rl.*`` keys read; setting another one is a config error),
``needs_old_logp``, ``needs_cap``, ``batch_keep`` (the update computes `m2po_keep` over
the step first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from tandem.rl.core.registry import Registry

_MAX_LOG_RATIO = 20.0


@dataclass
class CorrectionConfig:
    cap: float | None = 2.0  # C (tis, mis; decoupled: none = no cap)
    level: Literal["token", "sequence"] = "token"  # tis, mis
    proximal: Literal["recompute", "loglinear"] = "recompute"  # decoupled, m2po
    m2_threshold: float = 0.04  # m2po


@dataclass
class CorrectionInput:
    logp: Tensor  # [N, T] current policy, detached
    prox_logp: Tensor  # [N, T] proximal: the policy before this update (recomputed, or own)
    behav_logp: Tensor  # [N, T] behaviour: the generator's log-probs when it sampled
    mask: Tensor  # [N, T] 1 on trained tokens
    versions: Tensor | None = None  # [N, T] long: the version that sampled each token
    version: int = 0  # the version this update trains
    keep: Tensor | None = None  # [N, T] bool: m2po's tokens kept (`m2po_keep`, batch-wide)


@dataclass
class CorrectionOutput:
    old_logp: Tensor  # [N, T] what the policy loss's ratio divides by
    weight: Tensor  # [N, T] detached, multiplies the per-token policy loss (0: dropped)
    metrics: dict[str, Tensor] = field(default_factory=dict)


CorrectionFn = Callable[[CorrectionInput, CorrectionConfig], CorrectionOutput]
OFFPOLICY_CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")


def _log_rho(inp: CorrectionInput, prox: Tensor, level: str) -> Tensor:
    """log(prox / behav) per token, or its sum over each sequence's tokens (``sequence``)."""
    lr = torch.where(inp.mask.bool(), prox - inp.behav_logp, 0.0)
    if level == "sequence":
        lr = lr.sum(-1, keepdim=True).expand_as(lr)
    return lr.clamp(max=_MAX_LOG_RATIO)  # exp cannot overflow; below, it only underflows to 0


@OFFPOLICY_CORRECTIONS.register("none", uses=())
def none(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """The policy loss as written: no weight."""
    return CorrectionOutput(inp.prox_logp, torch.ones_like(inp.prox_logp))


@OFFPOLICY_CORRECTIONS.register("tis", uses=("tis_cap", "offpolicy_level"), needs_cap=True)
def tis(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Truncated importance sampling: ``min(rho, C)``."""
    rho = _log_rho(inp, inp.prox_logp, cfg.level).exp()
    return CorrectionOutput(inp.prox_logp, rho.clamp(max=cfg.cap))


@OFFPOLICY_CORRECTIONS.register("mis", uses=("tis_cap", "offpolicy_level"), needs_cap=True)
def mis(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """Masked importance sampling: ``rho`` where ``rho <= C``; above it the token (or sequence) is
    dropped."""
    rho = _log_rho(inp, inp.prox_logp, cfg.level).exp()
    return CorrectionOutput(inp.prox_logp, torch.where(rho <= cfg.cap, rho, 0.0))


def proximal_logp(inp: CorrectionInput, method: str) -> Tensor:
    """The proximal log-probs: recomputed (``inp.prox_logp``), or log-linear in the versions."""
    if method == "recompute":
        return inp.prox_logp
    if inp.versions is None:
        raise ValueError("the loglinear proximal policy needs each token's version")
    vb = inp.versions.to(inp.behav_logp.dtype)
    alpha = ((inp.version - vb) / (inp.version + 1 - vb)).clamp(0.0, 1.0)
    return inp.behav_logp + alpha * (inp.logp - inp.behav_logp)


@OFFPOLICY_CORRECTIONS.register("decoupled", uses=("tis_cap", "proximal"))
def decoupled(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """AReaL's decoupled PPO: the clip against the proximal policy, ``min(rho, C)`` (or ``rho``)."""
    prox = proximal_logp(inp, cfg.proximal)
    rho = _log_rho(inp, prox, "token").exp()
    return CorrectionOutput(prox, rho if cfg.cap is None else rho.clamp(max=cfg.cap))


@OFFPOLICY_CORRECTIONS.register(
    "m2po", uses=("proximal", "m2_threshold"), needs_old_logp=True, batch_keep=True
)
def m2po(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """M2PO: decoupled PPO without the cap, on the tokens `m2po_keep` kept."""
    if inp.keep is None:
        raise ValueError("m2po needs its batch-wide token mask (m2po_keep)")
    prox = proximal_logp(inp, cfg.proximal)
    rho = _log_rho(inp, prox, "token").exp()
    return CorrectionOutput(prox, torch.where(inp.keep, rho, 0.0))


def m2po_keep(
    m2: Tensor, mask: Tensor, threshold: float, gather: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """M2PO's tokens: drop the largest second moments ``m2 = (prox - behav)^2`` [N, T] until the
    mean of the kept ones is below ``threshold`` (at least one token kept), over the tokens
    of every rank (``gather`` concatenates a 1-D tensor over the data-parallel ranks).
    Ties with the last dropped value are dropped too, so the cut is a value, the same on
    every layout."""
    on = mask.bool()
    values = m2[on].double()
    every = gather(values) if gather is not None else values
    s, _ = every.sort(descending=True)
    n = s.numel()
    if n == 0:
        return on
    counts = torch.arange(n, 0, -1, dtype=s.dtype, device=s.device)
    suffix_mean = s.flip(0).cumsum(0).flip(0) / counts  # mean of what is left after s[:k]
    below = (suffix_mean < threshold).nonzero()
    k = int(below[0]) if below.numel() else n - 1  # tokens dropped
    if k == 0:
        return on
    cut = s[k - 1]  # the smallest dropped value
    if not bool((every < cut).any()):  # every value ties with it: keep the smallest ones
        return on & (m2.double() <= s[-1])
    return on & (m2.double() < cut)
