"""Triton kernel for ``rl.exact``'s matmul: ``c = a @ b (* alpha + beta * bias)``, each row
computed in an order that does not depend on how many rows there are.

Called through `kernels.batch_invariant` (its aten ``mm`` / ``addmm`` override), which
chooses between this kernel and the PyTorch reference `kernels.batch_invariant.tiled_mm`;
see that module for why. Imports Triton at the top, so `kernels.batch_invariant` imports
it lazily. Under ``TRITON_INTERPRET=1`` (set before Triton is first imported) it runs on
the CPU.

Why a row's result is independent of the batch:

* one program per ``BLOCK_M x BLOCK_N`` output tile, and the tile sizes are fixed per dtype
  (`CONFIG`), never chosen from ``M``: cuBLAS picks its kernel, its tiles and a split of
  ``K`` over thread blocks from the shape, so one row alone (decode) and the same row among
  thousands (the update's packed micro-batch) are reduced in different orders;
* no split-K, no stream-K, no atomics: each program walks ``K`` from 0 upwards in
  ``BLOCK_K`` steps into one fp32 accumulator (``tl.dot`` with an fp32 ``acc``), so an
  element's sum is the same sequence of operations wherever its row sits;
* rows past ``M`` and columns past ``K`` load as zeros, which change no sum;
* the bias is added in fp32 to the finished accumulator, then the result rounds once.

fp32 inputs use IEEE products (``input_precision="ieee"``, no TF32), as PyTorch does by
default. Under the interpreter the tile product is not ``tl.dot``: there ``tl.dot`` is
``numpy.matmul`` (OpenBLAS), which rounds a row differently depending on its position in
the tile (measured: 20 of 32 rows of a 32x32 @ 32x64 fp32 tile changed when moved to row 0;
the other rows' values never mattered), and which cannot read bf16 (stored as uint16 there).
So when interpreting, a tile's product is a broadcast multiply in fp32 and a ``tl.sum`` over
``K`` (numpy adds the ``K`` slices in order, the same in every row): the same loop, tiles
and masks, another inner product. On a GPU it is ``tl.dot`` on the tensor cores; that a
row's result there does not depend on its position in the tile is what the tests check
when run on CUDA (not yet done).
Not run on a GPU yet (no GPU was lent to the session that wrote it): the tile sizes are
a guess, and scripts/gpu_check.sh's part ``exact`` measures their cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import triton_interpreting

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per input dtype; never a function of M.
CONFIG: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (32, 64, 32, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.bfloat16: (64, 128, 64, 4, 3),
}
DTYPES = tuple(CONFIG)

# fmt: off


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_biasm, stride_biasn, stride_cm, stride_cn,
    alpha, beta,
    HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am  # [BM, 1]
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one fixed order over K: no split, whatever M is
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if INTERPRETED:  # the same order in every row (see the module docstring)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN] fp32
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm.to(tl.int64)[:, None] * stride_biasm + rn[None, :] * stride_biasn,
                       mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc = acc * alpha + bias.to(tl.float32) * beta
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# fmt: on


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, alpha: float = 1.0,
           beta: float = 1.0) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides; ``b`` is ``w.T`` for a linear layer), plus
    ``beta * bias`` (broadcastable to ``[M, N]``) with the product scaled by ``alpha`` when
    ``bias`` is given; returns ``[M, N]`` in ``a``'s dtype. Arguments are checked by the caller
    (same float dtype in `DTYPES`, same device)."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    bm, bn, bk, warps, stages = CONFIG[a.dtype]
    full = bias.expand(m, n) if bias is not None else c  # [M, N] view: stride 0 where broadcast
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    # fmt: off
    _mm_kernel[grid](
        a, b, full, c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), full.stride(0), full.stride(1), c.stride(0), c.stride(1),
        float(alpha), float(beta),
        HAS_BIAS=bias is not None, INTERPRETED=triton_interpreting(),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    # fmt: on
    return c
