"""A LoRA projection in one kernel: ``y = x W^T + b + ((s x A^T) B^T)`` (tandem/models/lora.py).

The PyTorch form (`lora_linear_ref`, what `LoraLinear` runs) is three matmuls and an add:
``x`` is read twice and the ``[M, N]`` low-rank product is written and read back once. The
Triton kernel computes an ``[BM, BN]`` output tile with both products in registers: one pass
over ``K`` accumulates ``x W^T`` and ``x A^T`` (``[BM, r]``, recomputed by each column tile:
``r / BN`` extra work on the small product), then adds ``(s x A^T) B^T`` and the bias before
the one store. The backward is PyTorch's matmuls, from ``x`` and the ``s x A^T`` the forward
kept (``[M, r]``).

Not used by default yet: nothing here was timed on a GPU, and no GPU was at hand. `LoraLinear`
takes it where ``advanced.kernels = "triton"`` (or ``impl="triton"``) is set, for plain tensors
(a TP-sharded DTensor input keeps the module path), so both forms can be timed on one
workload; under the Triton interpreter it is compared with the PyTorch form in
tests/kernels/test_lora_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem import device as seam
from tandem.kernels.dispatch import requested_impl, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch form needs no Triton
    triton = None

__all__ = ["lora_linear", "lora_linear_ref", "use_fused_lora"]


def lora_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """x ``[..., K]``, w ``[N, K]``, a ``[r, K]``, b ``[N, r]`` -> ``[..., N]``
    (LoraLinear's own ops)."""
    return F.linear(x, w, bias) + F.linear(F.linear(x, a) * scale, b)


def use_fused_lora(x: torch.Tensor, impl: str | None = None) -> bool:
    """Whether `lora_linear` takes the Triton kernel for ``x``: only where Triton is forced (it is
    untimed), and never for a DTensor (tensor parallelism keeps the module path)."""
    forced = requested_impl(impl)
    return forced == "triton" and type(x) is torch.Tensor and use_triton(x, forced)


def lora_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The fused form (see the module docstring); differentiable in x, w, bias, a and b."""
    return _FusedLora.apply(x, w, bias, a, b, scale)


class _FusedLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, a, b, scale):  # noqa: ANN001, ANN205
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        y, xa = _forward(x2, w, bias, a, b, scale)
        ctx.save_for_backward(x2, w, a, b, xa)
        ctx.scale, ctx.has_bias, ctx.shape = scale, bias is not None, shape
        return y.view(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x2, w, a, b, xa = ctx.saved_tensors  # xa = s x A^T  [M, r]
        g2 = g.reshape(-1, w.shape[0])  # [M, N]
        dlow = (g2 @ b) * ctx.scale  # [M, r]: the gradient of x A^T
        need = ctx.needs_input_grad
        dx = (g2 @ w + dlow @ a).view(ctx.shape) if need[0] else None
        dw = g2.t() @ x2 if need[1] else None
        dbias = g2.sum(0) if ctx.has_bias and need[2] else None
        da = dlow.t() @ x2 if need[3] else None
        db = g2.t() @ xa if need[4] else None
        return dx, dw, dbias, da, db, None


def _forward(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    n, r = w.shape[0], a.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    xa = torch.empty(m, r, dtype=x.dtype, device=x.device)
    if m == 0:
        return y, xa
    bm, bn, bk = (64, 64, 32) if seam.triton_supported(x.device) else (16, 16, 16)
    br = max(16, triton.next_power_of_2(r))  # tl.dot needs every dimension >= 16
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _lora_kernel[grid](
        x,
        w,
        bias if bias is not None else y,
        a,
        b,
        y,
        xa,
        m,
        n,
        k,
        r,
        float(scale),
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        BR=br,
    )
    return y, xa


if triton is not None:

    @triton.jit
    def _lora_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        a_ptr,
        b_ptr,
        y_ptr,
        xa_ptr,
        M,
        N,
        K,
        R,
        scale,
        sxm,
        sxk,
        swn,
        swk,
        sar,
        sak,
        sbn,
        sbr,
        HAS_BIAS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BR: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rr = tl.arange(0, BR)
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # x W^T
        low = tl.zeros((BM, BR), dtype=tl.float32)  # x A^T
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            xk = tl.load(
                x_ptr + rm[:, None] * sxm + rk[None, :] * sxk,
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )  # [BM, BK]
            wk = tl.load(
                w_ptr + rn[None, :] * swn + rk[:, None] * swk,
                mask=(rn[None, :] < N) & (rk[:, None] < K),
                other=0.0,
            )  # [BK, BN]
            ak = tl.load(
                a_ptr + rr[None, :] * sar + rk[:, None] * sak,
                mask=(rr[None, :] < R) & (rk[:, None] < K),
                other=0.0,
            )  # [BK, BR]
            acc += tl.dot(xk, wk)
            low += tl.dot(xk, ak)
        # rounded like the PyTorch form's s * (x A^T)
        low = (low * scale).to(x_ptr.dtype.element_ty)
        bt = tl.load(
            b_ptr + rn[None, :] * sbn + rr[:, None] * sbr,
            mask=(rn[None, :] < N) & (rr[:, None] < R),
            other=0.0,
        )  # [BR, BN]
        acc += tl.dot(low, bt)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * N + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )
        if pid_n == 0:  # the low-rank product, for the backward's gradient of B
            tl.store(
                xa_ptr + rm[:, None] * R + rr[None, :],
                low,
                mask=(rm[:, None] < M) & (rr[None, :] < R),
            )
