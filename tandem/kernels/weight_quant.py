"""Low-bit linear weights: the one quantizer the generation copy stores with and the update
rounds with (docs/low-precision.md).

Three formats of a weight ``w [N, K]`` (out, in features), each a `WeightFormat`:

- ``fp8_block``: e4m3 values, one scale per 128 x 128 block (DeepSeek-V3's weight blocks);
- ``mxfp8``: e4m3 values, one scale per 32 consecutive inputs of a row (OCP MX blocks), kept
  as its 8-bit exponent (e8m0: ``2**(e - 127)``);
- ``w4a16``: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; two to a byte), one
  e4m3 scale per 16 consecutive inputs times one fp32 scale per tensor (NVFP4's two levels),
  activations left in the compute dtype.

The FP8 formats' scales are powers of two, computed from the fp32 bits as the FP8 KV cache's
are (`tandem.kernels.kv_quant.scale_exponent`: the smallest ``2**k`` with ``amax <= 448 * 2**k``,
so nothing saturates): dividing by one is exact, so quantizing is e4m3's rounding alone, and a
dequantized value has at most 4 significant bits, exact in fp32 and bf16. The 4-bit format's
block scale is ``amax / 6`` over the tensor scale ``amax_tensor / (6 * 448)``, rounded to e4m3;
a block's largest entry may then sit just past 6 and is clamped there.

`fake_quant` is ``dequantize(quantize(w))`` with a straight-through gradient: the update's
forward (``rl.quantize_update``) and the generation copy's projections (`QuantLinear`) call the
same `quantize` and `dequantize`, so both multiply by the same numbers bit for bit.

Blocks are anchored at element (0, 0) of the tensor given; edge blocks are partial (a
``[100, 40]`` weight has one 128 x 128 block). A shard quantized alone is therefore the same as
the whole tensor's blocks only when its offset is a block multiple (and, for w4a16, it is given
the whole tensor's largest entry: ``quantize(..., tensor_amax=)``); tandem/parallel/quant_layout.py
says which generation layouts keep blocks whole.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import batch_invariant
from tandem.kernels.dispatch import requested_impl
from tandem.kernels.kv_quant import _StraightThrough as StraightThrough  # the KV path's
from tandem.kernels.kv_quant import exp2_int, scale_exponent

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign
# the midpoints between neighbours of the grid, and whether a tie there goes to the upper code
# (round half to even: the even code wins)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


@dataclass(frozen=True)
class WeightFormat:
    """One storage format: its block (rows x inputs) and its value bits."""

    name: str
    block: tuple[int, int]  # (rows, inputs) a scale covers
    bits: int  # bits per value

    def scale_bytes(self) -> int:
        return 4 if self.name == "fp8_block" else 1  # fp32 power of two; e8m0; e4m3


FORMATS = {
    "fp8_block": WeightFormat("fp8_block", (128, 128), 8),
    "mxfp8": WeightFormat("mxfp8", (1, 32), 8),
    "w4a16": WeightFormat("w4a16", (1, 16), 4),
}
WEIGHT_DTYPES = ("bf16", *FORMATS)  # rollout.weight_dtype; bf16: the copy's own dtype (no change)


def weight_format(name: str) -> WeightFormat:
    """``rollout.weight_dtype`` name -> its format (a ValueError names the value)."""
    if name not in FORMATS:
        raise ValueError(f"weight_dtype: expected one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]


@dataclass
class QuantizedWeight:
    """A weight in a `WeightFormat`: ``values`` (e4m3 ``[N, K]``, or uint8 ``[N, ceil(K/2)]``
    of two e2m1 codes, the even input in the low nibble), ``scales`` (one per block, fp32 for
    fp8_block, uint8 exponents for mxfp8, e4m3 for w4a16) and, for w4a16, the fp32 tensor
    scale."""

    fmt: WeightFormat
    shape: tuple[int, int]
    values: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        ts = [self.values, self.scales] + (
            [self.tensor_scale] if self.tensor_scale is not None else []
        )
        return sum(t.numel() * t.element_size() for t in ts)


def quantized_nbytes(shape: tuple[int, int], fmt: WeightFormat) -> int:
    """Bytes a ``shape`` weight takes in ``fmt`` (values, block scales and a w4a16 tensor scale),
    computed without quantizing: what `QuantizedWeight.nbytes` measures (the planner's figure)."""
    n, k = shape
    br, bk = fmt.block
    values = n * k if fmt.bits == 8 else n * ((k + 1) // 2)
    scales = math.ceil(n / br) * math.ceil(k / bk) * fmt.scale_bytes()
    return values + scales + (4 if fmt.bits == 4 else 0)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w [N, K]`` zero-padded to block multiples as ``[N/br, br, K/bk, bk]`` (fp32)."""
    n, k = w.shape
    br, bk = block
    nb, kb = math.ceil(n / br), math.ceil(k / bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * br - n))
    return padded.view(nb, br, kb, bk)


def _unblock(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    nb, br, kb, bk = x.shape
    return x.reshape(nb * br, kb * bk)[: shape[0], : shape[1]]


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest ``|w|`` of each block, ``[ceil(N/br), ceil(K/bk)]`` fp32."""
    return _blocks(w, block).abs().amax(dim=(1, 3))


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8: sign in bit 3, grid index in bits 0-2) of ``y`` (fp32, already
    scaled): round to the nearest grid value, ties to the even code, ``|y| > 6`` to 6."""
    a = y.abs()
    mids = torch.tensor(_E2M1_MIDS, device=y.device)
    up = torch.tensor(_E2M1_TIE_UP, device=y.device)
    above = (a[..., None] > mids) | ((a[..., None] == mids) & up)
    code = above.sum(-1).to(torch.uint8)
    return code | ((y < 0) & (code > 0)).to(torch.uint8) << 3


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (`round_e2m1`)."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    v = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -v, v)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes -> ``[N, ceil(K/2)]`` bytes, the even input in the low nibble."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)[:, :k]


def _fp8_scale_exponents(w: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    return scale_exponent(block_amax(w, fmt.block), E4M3)  # [nb, kb] int32


def _tensor_scale(w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The w4a16 tensor scale: ``amax / (6 * 448)`` (1 for an all-zero tensor), fp32; ``amax``:
    the whole tensor's, when ``w`` is a shard of it (default: ``w``'s own)."""
    amax = w.detach().float().abs().amax() if amax is None else amax.float()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def _fp4_block_scales(w: torch.Tensor, fmt: WeightFormat, ts: torch.Tensor) -> torch.Tensor:
    """Each block's e4m3 scale (relative to the tensor scale ``ts``)."""
    return (block_amax(w, fmt.block) / E2M1_MAX / ts).clamp(max=E4M3_MAX).to(E4M3)


def _expand(scales: torch.Tensor) -> torch.Tensor:
    """Per-block fp32 scales ``[nb, kb]`` as ``[nb, 1, kb, 1]`` against `_blocks`."""
    return scales[:, None, :, None]


def entry_scales(q: QuantizedWeight) -> torch.Tensor:
    """The fp32 scale each entry of ``q`` is multiplied by, ``[N, K]``."""
    nb, kb = q.scales.shape
    br, bk = q.fmt.block
    return _unblock(_expand(block_scales(q)).expand(nb, br, kb, bk), q.shape)


@torch.no_grad()
def quantize(
    w: torch.Tensor, fmt: WeightFormat | str, tensor_amax: torch.Tensor | None = None
) -> QuantizedWeight:
    """``w [N, K]`` in ``fmt`` (any float dtype in; the rounding is done in fp32).
    ``tensor_amax``: w4a16, the largest ``|entry|`` of the whole tensor ``w`` is a shard of; a
    shard whose offset is a block multiple then gets exactly the whole tensor's quantization of
    its entries."""
    fmt = weight_format(fmt) if isinstance(fmt, str) else fmt
    shape = (w.shape[0], w.shape[1])
    if fmt.bits == 8:
        k = _fp8_scale_exponents(w, fmt)
        s = exp2_int(k)
        y = (_blocks(w, fmt.block) * _expand(s.reciprocal())).clamp(-E4M3_MAX, E4M3_MAX)
        values = _unblock(y, shape).to(E4M3)
        scales = s if fmt.name == "fp8_block" else (k + 127).to(torch.uint8)
        return QuantizedWeight(fmt, shape, values, scales)
    ts = _tensor_scale(w, tensor_amax)
    sb = _fp4_block_scales(w, fmt, ts)
    full = sb.float() * ts  # [nb, kb]
    inv = torch.where(full > 0, full.reciprocal(), torch.zeros_like(full))
    codes = round_e2m1(_unblock(_blocks(w, fmt.block) * _expand(inv), shape))
    return QuantizedWeight(fmt, shape, _pack(codes), sb, ts)


def block_scales(q: QuantizedWeight) -> torch.Tensor:
    """The fp32 scale of every block, ``[nb, kb]``."""
    if q.fmt.name == "fp8_block":
        return q.scales
    if q.fmt.name == "mxfp8":
        return exp2_int(q.scales.int() - 127)
    assert q.tensor_scale is not None
    return q.scales.float() * q.tensor_scale


@functools.cache
def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` fp32: the two e2m1 values of each byte (low nibble first)."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return e2m1_values(_unpack(codes[:, None], 2))


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q`` stands for, ``[N, K]`` in ``dtype`` (computed in fp32: each value times
    its block's fp32 scale, one rounding-free product)."""
    n, k = q.shape
    if q.fmt.bits == 8:
        v = q.values.float()
    else:  # one table lookup per byte
        v = _e2m1_pairs(q.values.device)[q.values.long()].view(n, -1)[:, :k]
    br, bk = q.fmt.block
    s = block_scales(q)  # [nb, kb]
    if n % br == 0 and k % bk == 0:  # whole blocks: no padding
        return (v.view(n // br, br, k // bk, bk) * _expand(s)).view(n, k).to(dtype)
    return _unblock(_blocks(v, q.fmt.block) * _expand(s), q.shape).to(dtype)


def kernel_operands(
    q: QuantizedWeight,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int], bool]:
    """What tandem/kernels/triton_weight_quant.py reads of ``q``: the values as bytes, the fp32
    block scales, the shape, the block and whether the values are 4-bit."""
    values = q.values.view(torch.uint8) if q.fmt.bits == 8 else q.values
    scales = block_scales(q).float().contiguous()
    return values.contiguous(), scales, q.shape, q.fmt.block, q.fmt.bits == 4


def fake_quant(w: torch.Tensor, fmt: WeightFormat | str) -> torch.Tensor:
    """``dequantize(quantize(w))`` in w's dtype; the gradient passes straight through (the
    rounding's derivative taken as 1). Bit for bit what a `QuantLinear` of ``w`` multiplies by."""
    y = dequantize(quantize(w.detach(), fmt), w.dtype)
    return StraightThrough.apply(w, y) if w.requires_grad else y


def error_bound(w: torch.Tensor, fmt: WeightFormat | str) -> torch.Tensor:
    """The largest ``|dequantize(quantize(w)) - w|`` the format allows, per entry (fp32).

    FP8: half an e4m3 ulp of the scaled value (3 mantissa bits; below 2**-6 the subnormal
    step 2**-9), times the block scale; nothing saturates. w4a16: half the e2m1 grid step at
    the scaled value (0.25 below 2, 0.5 below 4, 1 above), times the block scale, plus what
    clamping at 6 loses (the e4m3 block scale is at most 1/16 below amax / 6)."""
    fmt = weight_format(fmt) if isinstance(fmt, str) else fmt
    q = quantize(w, fmt)
    s = entry_scales(q)
    y = w.float().abs() / torch.where(s > 0, s, torch.ones_like(s))
    if fmt.bits == 8:
        exp = torch.floor(torch.log2(y.clamp(min=2.0**-6)))
        return 0.5 * torch.exp2(exp - 3) * s
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    return (half_step + (y - E2M1_MAX).clamp(min=0)) * s


class QuantLinear(nn.Module):
    """A linear layer over a `QuantizedWeight`: each call dequantizes the weight into the input's
    dtype and runs ``F.linear`` (the same call an ``nn.Linear`` makes, so under
    ``rl.exact``'s batch-invariant kernels it is the update's product). Holds no full-precision
    weight; `load` requantizes a new one in place (the generation copy's refill)."""

    def __init__(self, q: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.fmt, self.shape = q.fmt, q.shape
        self.out_features, self.in_features = q.shape
        self.register_buffer("qvalues", q.values)
        self.register_buffer("qscales", q.scales)
        self.register_buffer("qtensor_scale", q.tensor_scale)
        self.bias = bias

    @classmethod
    def of(
        cls, fmt: WeightFormat | str, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> QuantLinear:
        return cls(quantize(weight, fmt), bias)

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.shape, self.qvalues, self.qscales, self.qtensor_scale)

    def nbytes(self) -> int:
        """Resident bytes of the quantized weight (the bias not counted)."""
        return self.quantized().nbytes()

    @torch.no_grad()
    def load(self, weight: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> None:
        """Requantize ``weight`` (this layer's shape; a shard of a tensor whose largest entry is
        ``tensor_amax``) into the held buffers, in place."""
        q = quantize(weight, self.fmt, tensor_amax)
        self.qvalues.copy_(q.values)
        self.qscales.copy_(q.scales)
        if q.tensor_scale is not None:
            self.qtensor_scale.copy_(q.tensor_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if requested_impl(None) == "triton" and not batch_invariant.enabled():
            from tandem.kernels import triton_weight_quant as tq  # forced only: untimed on GPUs

            if tq.use_quant_linear_kernel(x):
                return tq.quant_linear_triton(x, kernel_operands(self.quantized()), self.bias)
        return F.linear(x, dequantize(self.quantized(), x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.fmt.name}"


class FakeQuantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward multiplies by `fake_quant` of its weight (straight-through
    gradient): the update's side of ``rl.quantize_update``. Same parameters, same state dict
    (`fake_quant_linear` turns a linear into one in place)."""

    fmt: WeightFormat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quant(self.weight, self.fmt), self.bias)


def fake_quant_linear(linear: nn.Linear, fmt: WeightFormat | str) -> None:
    """Turn a plain ``nn.Linear`` into a `FakeQuantLinear` of ``fmt``, in place."""
    assert type(linear) is nn.Linear, type(linear)
    linear.__class__ = FakeQuantLinear
    linear.fmt = weight_format(fmt) if isinstance(fmt, str) else fmt
