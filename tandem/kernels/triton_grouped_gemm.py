"""Triton kernels for the MoE grouped GEMM: ``y = x_run @ w[e]`` and ``dw[e] = x_e^T @ dy_e``.

Called only through `tandem.kernels.grouped_gemm`, which checks arguments and chooses
the implementation; see that module for the semantics. Imports Triton at the
top, so `tandem.kernels.grouped_gemm` imports it lazily. Under ``TRITON_INTERPRET=1``
(set before Triton is first imported) the kernels run on CPU.

Design notes:

* Forward tiles each expert's run of rows separately, so no tile straddles two
  experts. The number of such tiles, ``sum_e ceil(rows_e / BLOCK_M)``, is at
  most ``ceil(M / BLOCK_M) + E``; the grid is that bound, and each program finds
  its (expert, tile) by walking the ``E`` offsets (a scalar loop). Programs past
  the real tile count do nothing. No host sync: the grid is derived from shapes.
* ``BLOCK_M`` follows the average run length (``M / E`` rounded to a power of
  two, clamped to 16..64), so decode batches with a handful of rows per expert
  do not pay for 64-row tiles.
* The weight gradient has one program per (expert, K tile, N tile) looping over
  the expert's rows; an expert with no rows writes zeros.
* fp32 inputs use IEEE dot products (not TF32) so results match the reference;
  accumulation is fp32 and the output is rounded to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fmt: off


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, offs_ptr,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    K, N, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Which expert's run, and which BLOCK_M-row tile of it, this program owns.
    zero = pid_m * 0
    expert, row0, row_end, prev, tiles = zero - 1, zero, zero, zero, zero
    for i in range(0, E):
        end = tl.load(offs_ptr + i)
        n_tiles = (end - prev + BLOCK_M - 1) // BLOCK_M
        hit = (pid_m >= tiles) & (pid_m < tiles + n_tiles)
        expert = tl.where(hit, i, expert)
        row0 = tl.where(hit, prev + (pid_m - tiles) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tiles += n_tiles
        prev = end
    if expert >= 0:
        rm = row0 + tl.arange(0, BLOCK_M)  # [BM]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        rk = tl.arange(0, BLOCK_K)  # [BK]
        m_ok = rm < row_end
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
        w_base = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :] * stride_wn  # [1, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_base + kk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN]
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    K, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.load(offs_ptr + e)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_ok = rk < K
    n_ok = rn < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)  # [BM]
        m_ok = rm < end
        rm64 = rm.to(tl.int64)
        # x_e^T tile [BK, BM] and dy tile [BM, BN]
        a = tl.load(x_ptr + rm64[None, :] * stride_xm + rk[:, None] * stride_xk,
                    mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(dy_ptr + rm64[:, None] * stride_dym + rn[None, :] * stride_dyn,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dw = dw_ptr + e.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rn[None, :] * stride_wn
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# fmt: on


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(rows: int, experts: int) -> int:
    return max(16, min(64, triton.next_power_of_2(max(1, rows // max(1, experts)))))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton forward: ``y [M, N]`` (arguments already checked by the caller)."""
    m, k = x.shape
    e, _, n = w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm, bn, bk = _block_m(m, e), 64, 32
    grid = (triton.cdiv(m, bm) + e, triton.cdiv(n, bn))
    # fmt: off
    _grouped_mm_kernel[grid](
        x, w, y, offsets.contiguous(),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        k, n, e,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype), num_warps=4,
    )
    # fmt: on
    return y


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton ``dw [E, K, N]``: ``x_e^T @ dy_e`` per expert run (zeros for an empty run)."""
    m, k = x.shape
    n = dy.shape[1]
    e = offsets.shape[0]
    dw = torch.empty(e, k, n, dtype=x.dtype, device=x.device)
    if e == 0 or k == 0 or n == 0:
        return dw
    bm, bn, bk = 32, 64, 32
    grid = (e, triton.cdiv(k, bk), triton.cdiv(n, bn))
    # fmt: off
    _grouped_wgrad_kernel[grid](
        x, dy, dw, offsets.contiguous(),
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1),
        dw.stride(2), k, n,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype), num_warps=4,
    )
    # fmt: on
    return dw
