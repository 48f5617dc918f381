"""The on-policy distillation losses (reverse KL, full and sampled; the distillation
advantages) against hand-written loops on small fixed logits."""

from __future__ import annotations

import math

import torch

from tandem.rl.algorithms import opd_advantages, reverse_kl_full, reverse_kl_sampled
from tests.algorithms.test_algorithms import assert_close

STUDENT = torch.tensor(
    [
        [[1.0, 0.0, -1.0, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 0.1, 0.2, 0.3]],
        [[-1.0, 1.0, 0.0, 0.0, 0.5], [0.2, 0.4, 0.6, 0.8, 1.0], [9.0, 9.0, 9.0, 9.0, 9.0]],
    ]
)
TEACHER = torch.tensor(
    [
        [[0.5, 0.5, 0.0, 0.0, 1.0], [1.0, -1.0, 0.0, 2.0, 0.0], [2.0, -1.0, 0.0, 0.0, 1.0]],
        [[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.8, 0.6, 0.4, 0.2], [0.0, 0.0, 0.0, 0.0, 0.0]],
    ]
)
DMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _log_softmax_list(xs):
    z = math.log(sum(math.exp(x) for x in xs))
    return [x - z for x in xs]


def test_reverse_kl_full_matches_loop():
    want = torch.zeros(2, 3)
    for n in range(2):
        for t in range(3):
            if DMASK[n, t] == 0:
                continue
            ls = _log_softmax_list(STUDENT[n, t].tolist())
            lt = _log_softmax_list(TEACHER[n, t].tolist())
            want[n, t] = sum(math.exp(a) * (a - b) for a, b in zip(ls, lt, strict=True))
    assert_close(reverse_kl_full(STUDENT, TEACHER, DMASK), want)
    assert torch.allclose(reverse_kl_full(STUDENT, STUDENT, DMASK), torch.zeros(2, 3), atol=1e-6)


def test_reverse_kl_sampled_is_unbiased():
    log_ps = torch.log_softmax(STUDENT, -1)  # [2, 3, V]
    log_pt = torch.log_softmax(TEACHER, -1)
    assert torch.equal(reverse_kl_sampled(log_ps[..., 0], log_ps[..., 0]), torch.zeros(2, 3))
    gen = torch.Generator().manual_seed(0)
    draws = 40_000
    # [6, draws]
    tokens = torch.multinomial(log_ps.exp().reshape(6, 5), draws, replacement=True, generator=gen)
    ls = log_ps.reshape(6, 5).gather(1, tokens)
    lt = log_pt.reshape(6, 5).gather(1, tokens)
    mc = reverse_kl_sampled(ls, lt).mean(1).reshape(2, 3) * DMASK
    full = reverse_kl_full(STUDENT, TEACHER, DMASK)
    assert torch.allclose(mc, full, atol=0.03), (mc, full)
    keep = torch.ones_like(ls)
    keep[:, 1] = 0
    want = -(ls - lt) * keep
    assert_close(opd_advantages(ls, lt, keep), want)
