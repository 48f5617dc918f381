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
- `chunk_reverse_kl` / `chunk_opd_advantages`: the same over chunks, for a
  teacher with another tokenizer (tandem/rl/update/xtok_alignment.py): a chunk is a span
  of the completion whose ends are token boundaries for both models, and its
  estimate is ``log p_s(chunk) - log p_t(chunk)``, each the sum of that
  model's token log-probs. Every student token of a chunk carries the whole
  chunk's estimate: ``-d_c * sum_j grad log p_s(y_j)`` is ``-d_c * grad log
  p_s(chunk)``, the score-function gradient of the chunk's term, where an
  equal split would weight a chunk by one over its length. With one token per
  chunk (the same tokenizer) both are exactly `opd_advantages`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "chunk_opd_advantages",
    "chunk_reverse_kl",
    "chunk_sums",
    "opd_advantages",
    "reverse_kl_full",
    "reverse_kl_sampled",
]


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
    """Per-token OPD advantage ``-(log p_s - log p_t)``, detached, zero outside the mask;
    ``[N, T]``."""
    adv = -reverse_kl_sampled(student_logp.detach(), teacher_logp.detach())
    return torch.where(mask.bool(), adv, 0.0)


def chunk_sums(values: Tensor, chunk_ids: Tensor, num_chunks: int) -> Tensor:
    """Per-row sums of ``values`` [N, T] over the tokens of each chunk -> ``[N, num_chunks]``.

    chunk_ids: ``[N, T]`` long, the chunk of each token, -1 for none. A chunk of one
    token gets that token's value bit for bit (the sums start from -0.0, and
    ``-0.0 + x == x`` for every float x)."""
    idx = torch.where(chunk_ids >= 0, chunk_ids, num_chunks)  # [N, T]; -1 -> a discarded column
    out = values.new_full((values.shape[0], num_chunks + 1), -0.0)
    return out.scatter_add_(1, idx, values)[:, :num_chunks]


def chunk_reverse_kl(student_logp: Tensor, teacher_chunk_logp: Tensor, chunk_ids: Tensor) -> Tensor:
    """``log p_s(chunk) - log p_t(chunk)`` per chunk; ``[N, C]`` (C = teacher_chunk_logp.shape[1]).

    student_logp: ``[N, T]`` per student token; teacher_chunk_logp: ``[N, C]`` the teacher's
    log-prob of each chunk; chunk_ids: ``[N, T]`` (-1 = the token is in no chunk)."""
    s = chunk_sums(student_logp.detach(), chunk_ids, teacher_chunk_logp.shape[1])  # [N, C]
    return s - teacher_chunk_logp.detach()


def chunk_opd_advantages(
    student_logp: Tensor, teacher_chunk_logp: Tensor, chunk_ids: Tensor, mask: Tensor
) -> Tensor:
    """Per-token OPD advantage ``-(log p_s(chunk) - log p_t(chunk))`` of each token's chunk;
    ``[N, T]``, zero outside the mask and on tokens in no chunk."""
    d = chunk_reverse_kl(student_logp, teacher_chunk_logp, chunk_ids)  # [N, C]
    per_token = d.gather(1, chunk_ids.clamp(min=0))  # [N, T]
    return torch.where(mask.bool() & (chunk_ids >= 0), -per_token, 0.0)
