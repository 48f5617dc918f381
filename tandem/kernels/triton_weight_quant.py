"""Triton kernels over low-bit weights (tandem/kernels/weight_quant.py): the product
``x @ dequantize(q).T`` with the weight decoded in registers, tile by tile, never written out in
full precision; and the decode alone (``dequantize_triton``), which the tests compare with the
PyTorch reference bit for bit.

Each value is decoded from its bits into fp32 exactly: an e4m3 byte ``s eeee mmm`` is
``(-1)**s * (1 + m/8) * 2**(e - 7)`` (``e = 0``: ``m * 2**-9``), built as fp32 bits; an e2m1
nibble ``s ee m`` is ``(-1)**s * (1 + m/2) * 2**(e - 1)`` (``e = 0``: ``m / 2``). The block scales
come in as fp32 (`weight_quant.block_scales`, one per block); `weight_quant.kernel_operands`
gives a weight's operands (this module imports nothing of weight_quant). The product then sums
in another order than ``F.linear``, so it equals the reference to float tolerance, not bitwise:
``rl.exact`` keeps the PyTorch path.

Not used by default yet: nothing here was timed on a GPU. `QuantLinear` takes it only under
``advanced.kernels = "triton"`` (or ``impl="triton"``), like tandem/kernels/sampling_noise.py.
"""

from __future__ import annotations

import torch

from tandem.kernels.dispatch import requested_impl, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch reference needs no Triton
    triton = None

__all__ = ["dequantize_triton", "quant_linear_triton", "use_quant_linear_kernel"]
BK = 16  # the inputs one step of the K loop decodes: divides every format's block


def use_quant_linear_kernel(x: torch.Tensor, impl: str | None = None) -> bool:
    """Whether `quant_linear_triton` serves ``x``: only where Triton is forced
    (`tandem.kernels.dispatch.requested_impl`), as it is untimed; raises like `use_triton` where
    forced Triton cannot run."""
    forced = requested_impl(impl)
    return forced == "triton" and use_triton(x, forced)


Operands = tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int], bool]


def dequantize_triton(w: Operands) -> torch.Tensor:
    """``dequantize(q)`` (fp32 ``[N, K]``) decoded by the kernel's own bit arithmetic; ``w``:
    (values as uint8, fp32 block scales ``[nb, kb]``, (N, K), the block, whether 4-bit)."""
    values, scales, (n, k), (br, bk), fp4 = w
    out = torch.empty(n, k, dtype=torch.float32, device=values.device)
    bn = 16
    _decode_kernel[(triton.cdiv(n, bn), triton.cdiv(k, BK))](
        values, scales, out, n, k, values.shape[1], scales.shape[1], br, bk,
        BN=bn, BK=BK, FP4=fp4,
    )  # fmt: skip
    return out


def quant_linear_triton(x: torch.Tensor, w: Operands, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(q), bias)`` for ``x [..., K]``, in x's dtype (fp32 sums)."""
    values, scales, (n, k), (br, bk), fp4 = w
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bm, bn = 16, 32
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        rows, values, scales, out, m, n, k, values.shape[1], scales.shape[1], br, bk,
        BM=bm, BN=bn, BK=BK, FP4=fp4,
    )  # fmt: skip
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _decode(values_ptr, scales_ptr, rows, cols, N, K, row_bytes, KB, BR, BKS, FP4):
        """fp32 weights ``[len(rows), len(cols)]`` (0 outside the weight)."""
        inside = (rows[:, None] < N) & (cols[None, :] < K)
        if FP4:
            byte = tl.load(
                values_ptr + rows[:, None] * row_bytes + cols[None, :] // 2, mask=inside, other=0
            ).to(tl.int32)
            code = tl.where(cols[None, :] % 2 == 0, byte & 15, byte >> 4)
            sign, e, mant = code >> 3, (code >> 1) & 3, code & 1
            normal = ((e + 126) << 23) | (mant << 22)  # (1 + m/2) * 2**(e - 1)
            sub = mant.to(tl.float32) * 0.5
        else:
            code = tl.load(
                values_ptr + rows[:, None] * row_bytes + cols[None, :], mask=inside, other=0
            ).to(tl.int32)
            sign, e, mant = code >> 7, (code >> 3) & 15, code & 7
            normal = ((e + 120) << 23) | (mant << 20)  # (1 + m/8) * 2**(e - 7)
            sub = mant.to(tl.float32) * (1.0 / 512.0)
        mag = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
        v = tl.where(sign == 1, -mag, mag)
        s = tl.load(scales_ptr + (rows[:, None] // BR) * KB + cols[None, :] // BKS, mask=inside)
        return tl.where(inside, v * s, 0.0)

    @triton.jit
    def _decode_kernel(
        values_ptr, scales_ptr, out_ptr, N, K, row_bytes, KB, BR, BKS,
        BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        w = _decode(values_ptr, scales_ptr, rows, cols, N, K, row_bytes, KB, BR, BKS, FP4)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], w, mask=mask)

    @triton.jit
    def _linear_kernel(
        x_ptr, values_ptr, scales_ptr, out_ptr, M, N, K, row_bytes, KB, BR, BKS,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
    ):  # fmt: skip
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ck = k0 + tl.arange(0, BK)
            xm = (rm[:, None] < M) & (ck[None, :] < K)
            xt = tl.load(x_ptr + rm[:, None] * K + ck[None, :], mask=xm, other=0.0).to(tl.float32)
            w = _decode(values_ptr, scales_ptr, rn, ck, N, K, row_bytes, KB, BR, BKS, FP4)
            acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask)
