"""Grouped GEMM and token permutation: Triton and torch paths against the per-expert loop.

Gradients of `grouped_mm` (a hand-written backward) are compared with autograd
through `grouped_mm_ref`, a loop of plain matmuls. Without CUDA the Triton
kernels run under the interpreter; as in test_paged_attention.py, if triton was
imported before ``TRITON_INTERPRET`` was set, the in-process tests are skipped
and `test_all_in_clean_subprocess` runs this file in a fresh interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tandem.kernels.grouped_gemm import (  # noqa: E402
    grouped_mm,
    grouped_mm_ref,
    permute_tokens,
    torch_grouped_mm_applies,
    unpermute_tokens,
)
from tests.kernels.interpreted import interpreter_guard  # noqa: E402

_needs_usable_triton, test_all_in_clean_subprocess = interpreter_guard(__file__)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Runs of uneven length, including empty experts first, in the middle and last.
COUNTS = [0, 5, 40, 0, 3, 17, 1, 0]


def _problem(
    counts: list[int], k: int, n: int, dtype=torch.float32, seed: int = 0, transposed: bool = True
):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    # The model passes w1.transpose(1, 2) views of [E, N, K] parameters: test that layout too.
    w = (
        torch.randn(e, n, k, generator=g).transpose(1, 2)
        if transposed
        else torch.randn(e, k, n, generator=g)
    )
    offsets = torch.tensor(counts).cumsum(0).to(DEVICE, torch.int32)
    return x, w.to(DEVICE, dtype), offsets


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("transposed", [True, False])
def test_forward_and_gradients_equal_the_loop(impl, transposed):
    x, w, offsets = _problem(COUNTS, 24, 40, transposed=transposed)
    xa, wa = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, yr = grouped_mm(xa, wa, offsets, impl=impl), grouped_mm_ref(xr, wr, offsets)
    assert y.shape == (66, 40)
    assert (y - yr).abs().max().item() <= 1e-5
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y.backward(dy)
    yr.backward(dy)
    assert (xa.grad - xr.grad).abs().max().item() <= 1e-5
    assert (wa.grad - wr.grad).abs().max().item() <= 1e-5
    assert torch.equal(wa.grad[0], torch.zeros_like(wa.grad[0]))  # an expert with no rows


# The Triton interpreter has no bf16 (as in the other kernel tests): fp16 there.
HALF = [("torch", torch.bfloat16), ("torch", torch.float16), ("triton", torch.float16)] + (
    [("triton", torch.bfloat16)] if torch.cuda.is_available() else []
)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_expanded_gradient(impl):
    """``y.sum().backward()`` hands backward a [0, 0]-stride gradient, which raw
    ``torch._grouped_mm`` rejects on CPU ("Invalid strides/sizes")."""
    x, w, offsets = _problem([7, 0, 30, 12], 32, 48, seed=2)
    xa = x.clone().requires_grad_()
    grouped_mm(xa, w, offsets, impl=impl).sum().backward()
    xr = x.clone().requires_grad_()
    grouped_mm_ref(xr, w, offsets).sum().backward()
    assert (xa.grad - xr.grad).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("impl", "dtype"), HALF, ids=[f"{i}-{str(d)[6:]}" for i, d in HALF])
def test_half_precision_rounds_like_the_loop(impl, dtype):
    """fp32 accumulation, one rounding: within a few half-precision ulps of the fp32 loop."""
    x, w, offsets = _problem([7, 0, 30, 12], 32, 48, seed=2)
    xh, wh = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    y = grouped_mm(xh, wh, offsets, impl=impl)
    assert y.dtype == dtype
    ref = grouped_mm_ref(xh.detach().float(), wh.detach().float(), offsets)
    eps = torch.finfo(dtype).eps
    assert ((y.float() - ref).abs() / (ref.abs() + 1)).max().item() <= 4 * eps
    y.backward(torch.ones_like(y))
    assert wh.grad.dtype == dtype and torch.isfinite(wh.grad.float()).all()


def test_torch_grouped_mm_applies_on_cpu():
    x = torch.zeros(2, 2)
    assert torch_grouped_mm_applies(x) == hasattr(torch, "_grouped_mm")
    assert not torch_grouped_mm_applies(torch.zeros(2, 2, dtype=torch.int32))


def test_argument_errors():
    x, w, offsets = _problem([3, 4], 8, 8)
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(x, w, offsets.long())
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        grouped_mm(x[:, :4], w, offsets)


def test_permute_unpermute_equal_a_loop():
    g = torch.Generator().manual_seed(3)
    t, k, e = 11, 3, 5
    # [T, k] distinct per token
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[0] = torch.tensor([4, 1, 0])
    order, offsets = permute_tokens(ids, e)
    flat = ids.reshape(-1).tolist()
    # Sorted by expert, ties in token order; offsets are the cumulative counts.
    want = sorted(range(t * k), key=lambda i: (flat[i], i))
    assert order.tolist() == want
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [sum(1 for f in flat if f <= j) for j in range(e)]
    # unpermute(y_sorted) = sum_j w[t, j] * y[t, j] with y read back in token order.
    y = torch.randn(t * k, 6, generator=g)  # per (token, slot) in flat order
    weights = torch.rand(t, k, generator=g)
    got = unpermute_tokens(y[order], order, weights)
    for tok in range(t):
        expect = sum(weights[tok, j] * y[tok * k + j] for j in range(k))
        assert torch.allclose(got[tok], expect, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_many_experts_few_rows(impl):
    """Decode-like: more experts than rows (most runs empty), small tiles."""
    counts = [0] * 10 + [1, 0, 2] + [0] * 11
    x, w, offsets = _problem(counts, 16, 16, seed=4)
    xa, wa = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = grouped_mm(xa, wa, offsets, impl=impl)
    assert (y - grouped_mm_ref(x, w, offsets)).abs().max().item() <= 1e-5
    y.backward(torch.ones_like(y))
    wr = w.detach().clone().requires_grad_()
    grouped_mm_ref(x, wr, offsets).backward(torch.ones_like(y))
    assert (wa.grad - wr.grad).abs().max().item() <= 1e-5


def test_moe_block_on_triton_equals_torch(kernels):
    """The model's MoE block (three grouped GEMMs per layer) through each path, forward
    and backward."""
    from tandem.models import get_flavor
    from tandem.models.moe import MoE

    torch.manual_seed(0)
    block = MoE(get_flavor("debug-qwen3-moe")).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = {}
    for impl in ("torch", "triton"):
        kernels(impl)
        block.zero_grad()
        y = block(x)
        y.square().sum().backward()
        results[impl] = (y.detach(), [p.grad.clone() for p in block.parameters()])
    (y_t, g_t), (y_tr, g_tr) = results["torch"], results["triton"]
    assert (y_t - y_tr).abs().max().item() <= 1e-5
    for a, b in zip(g_t, g_tr, strict=True):  # gradients reach |g| ~ 300 here: relative
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
