"""Critic loss for PPO with GAE (arXiv 1707.06347).

``value_loss`` returns the per-token loss ``[N, T]``; aggregate it like the policy
loss (e.g. ``token_mean`` with the step's global norm). Targets are the ``returns``
of the ``gae`` advantage estimator.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["value_loss"]


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> Tensor:
    """Clipped value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``; ``[N, T]``, zero
    outside the mask.

    v_clip = old_values + clamp(values - old_values, -clip, clip) keeps the new
    value estimate within ``clip`` of the one the advantages were computed with.
    With ``clip=None`` this is the plain ``0.5 * (v - R)^2``.
    """
    returns = returns.detach()
    loss = (values - returns) ** 2  # [N, T]
    if clip is not None:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    return torch.where(mask.bool(), 0.5 * loss, 0.0)
