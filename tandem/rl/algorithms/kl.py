"""Per-token KL estimators between the policy and a reference policy.

Registry ``KL_ESTIMATORS``; every entry has the signature
``fn(logp [N, T], ref_logp [N, T]) -> [N, T]``, evaluated on tokens sampled from
the policy. With ``log r = ref_logp - logp`` (J. Schulman, "Approximating KL
Divergence", 2020, http://joschu.net/blog/kl-approx.html):

- ``k1 = -log r``: unbiased for KL(pi || ref), high variance, can be negative.
- ``k2 = 0.5 (log r)^2``: biased but low variance, always >= 0.
- ``k3 = (r - 1) - log r``: unbiased and always >= 0. Departure: ``log r`` is
  clamped to [-10, 10] before ``exp`` so a single token cannot overflow.

Two ways to use a KL penalty with coefficient beta:

1. As a reward penalty (`kl_penalty_rewards`): ``token_rewards = -beta * kl``,
   detached, fed to the advantage estimator (`AdvantageInput.token_rewards`).
   The KL then acts through the advantages, like any reward; k1 is the usual
   choice here since its sum over a sequence is that sequence's log-ratio.
2. As a loss term (`kl_loss_term`): the caller adds ``beta * kl`` (with grad) to
   the per-token policy loss before aggregation (GRPO, arXiv 2402.03300, uses
   k3 this way). Mind the gradients: on samples from the policy, k1's gradient
   has zero mean (it does not penalise anything), k2's gradient is an unbiased
   estimate of grad KL(pi || ref), and k3's gradient estimates grad KL(ref || pi)
   (the forward KL), not the reverse KL its value estimates.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from tandem.rl.core.registry import Registry

__all__ = ["KL_ESTIMATORS", "KL_MODES", "KLFn", "kl_loss_term", "kl_penalty_rewards"]

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")
# How the KL penalty enters (``rl.kl_mode``): entries take (logp, ref_logp, mask, beta,
# estimator) and declare ``in_loss`` (a term of the per-token loss, with grad) and
# ``needs_old_logp`` (computed from the policy's log-probs before the update, so the
# update needs a separate forward for them).
KL_MODES: Registry[Callable[..., Tensor]] = Registry("KL mode")

_K3_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp - ref_logp; ``[N, T]``."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * (logp - ref_logp)^2; ``[N, T]``."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """exp(x) - x - 1 with x = clamp(ref_logp - logp, -10, 10); ``[N, T]``, >= 0."""
    x = (ref_logp - logp).clamp(-_K3_CLAMP, _K3_CLAMP)
    return x.expm1() - x


@KL_MODES.register("reward", in_loss=False, needs_old_logp=True)
def kl_penalty_rewards(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float, estimator: str = "k1"
) -> Tensor:
    """Reward-penalty mode: ``-beta * kl`` per token, detached, zero outside the mask;
    ``[N, T]``."""
    kl = KL_ESTIMATORS.get(estimator)(logp.detach(), ref_logp.detach())
    return -beta * kl * mask.to(kl.dtype)


@KL_MODES.register("loss", in_loss=True, needs_old_logp=False)
def kl_loss_term(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float, estimator: str = "k3"
) -> Tensor:
    """Loss-term mode: ``beta * kl`` per token, with grad through ``logp``; ``[N, T]``.

    Zero outside the mask.

    Add it to the per-token policy loss, then aggregate both together.
    """
    kl = KL_ESTIMATORS.get(estimator)(logp, ref_logp.detach())
    return beta * kl * mask.to(kl.dtype)
