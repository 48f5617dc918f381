"""tandem/kernels/batch_invariant.py against plain PyTorch references, and its invariances."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import batch_invariant as bi
from tandem.models.attention import DocumentAttention, ExactAttention


def test_tree_sum_matches_sum_and_ignores_trailing_zeros():
    x = torch.randn(5, 37, dtype=torch.float64)
    torch.testing.assert_close(bi.tree_sum(x), x.sum(-1))
    y = torch.randn(3, 21)
    padded = F.pad(y, (0, 100))
    assert torch.equal(bi.tree_sum(y), bi.tree_sum(padded))


def test_tiled_mm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(96, 200, generator=g).to(dtype)
        x = torch.randn(70, 96, generator=g).to(dtype)
        alone = torch.cat([bi.tiled_mm(x[i : i + 1], w) for i in range(70)])
        for m in (2, 7, 16, 70):
            assert torch.equal(bi.tiled_mm(x[:m], w), alone[:m]), (dtype, m)
        torch.testing.assert_close(
            alone.float(),
            (x.float() @ w.float()),
            atol=0.1 if dtype == torch.bfloat16 else 1e-4,
            rtol=0.02 if dtype == torch.bfloat16 else 1e-5,
        )
    with bi.exact_mode():  # the override routes nn.Linear through the tiles
        lin = torch.nn.Linear(96, 40, bias=True)
        one = lin(x[:1].float())
        assert torch.equal(lin(x.float())[:1], one)
    assert not bi.enabled()


def test_logsumexp_matches_torch():
    z = torch.randn(6, 3000) * 5
    torch.testing.assert_close(bi.logsumexp(z), torch.logsumexp(z, -1))


def test_exact_attention_matches_masked_sdpa_with_gradients():
    """ExactAttention over packed documents with shared-prefix branches vs DocumentAttention."""
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 2, [2] * 14])
    branch = torch.tensor([[0] * 5 + [0, 0, 0, 1, 1, 2, 2] + [0, 0], [0] * 14])
    q = torch.randn(2, 14, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 14, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 14, 2, 16, generator=g, requires_grad=True)
    got = ExactAttention(doc, branch)(0, q, k, v)
    want = DocumentAttention(doc, branch)(0, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (gq, gk), (wq, wk) = (torch.autograd.grad(o.square().sum(), (q, k)) for o in (got, want))
    torch.testing.assert_close(gq, wq, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gk, wk, atol=1e-4, rtol=1e-4)
