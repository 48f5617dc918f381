"""On-policy distillation (OPD) signals: the student samples, a teacher scores.

The student is trained to minimise the reverse KL, KL(p_s || p_t), on its own
samples (mode-seeking; e.g. "On-Policy Distillation of Language Models", arXiv
2306.13649, and Thinking Machines' "On-Policy Distillation", 2025).

- `reverse_kl_full`: exact per-position reverse KL over the vocabulary, for
  tests and small vocabularies (it materialises ``[N, T, V]`` log-softmaxes).
- `reverse_kl_sampled`: ``log p_s(y_t) - log p_t(y_t)`` on the sampled token;
  with ``y_t ~ p_s`` its expectation is the full reverse KL at that position.
- `opd_advantages`: its negative, detached and masked, as per-token advantages
  for a policy loss (e.g. ``reinforce`` or ``ppo_clip``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["opd_advantages", "reverse_kl_full", "reverse_kl_sampled"]


def reverse_kl_full(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """sum_v p_s(v) (log p_s(v) - log p_t(v)) per position, zero outside the mask; ``[N, T]``.

    student_logits, teacher_logits: ``[N, T, V]``; computed in float32.
    """
    log_ps = torch.log_softmax(student_logits.float(), dim=-1)  # [N, T, V]
    log_pt = torch.log_softmax(teacher_logits.float(), dim=-1)  # [N, T, V]
    kl = (log_ps.exp() * (log_ps - log_pt)).sum(-1)  # [N, T]
    return torch.where(mask.bool(), kl, 0.0)


def reverse_kl_sampled(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """student_logp - teacher_logp on the sampled tokens; ``[N, T]`` (the caller masks)."""
    return student_logp - teacher_logp


def opd_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token OPD advantage ``-(log p_s - log p_t)``, detached, zero outside the mask; ``[N, T]``."""
    adv = -reverse_kl_sampled(student_logp.detach(), teacher_logp.detach())
    return torch.where(mask.bool(), adv, 0.0)
