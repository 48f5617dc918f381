"""FP8 keys and values: the quantizer the paged KV pool stores with, and the update's copy of it.

An FP8 pool entry is ``round_fp8(clamp(x / s, -M, M))`` and reads back as ``fp8 * s``, where
``M`` is the format's largest finite value (448 for e4m3, 57344 for e5m2) and ``s`` a scale:
one per (layer, KV head) calibrated from the policy (`scale_from_amax` of an amax), or one per
(token, KV head) computed from the entry itself as it is written (``per_token``).

Every scale is a power of two, the smallest ``2**k`` with ``amax <= M * 2**k``. Dividing by it
is exact, so quantizing is the format's rounding alone, the same bits in PyTorch and in the
Triton store kernel; and ``fp8 * s`` has at most 4 significant bits, so a dequantized entry is
exact in fp32, bf16 and fp16 (away from fp16's range ends). The update applies the very same
rounding to its own K and V (`KVQuantAttention`), so a rollout in bf16 that reads dequantized
keys and a training forward in bf16 that reads fake-quantized ones see the same numbers.
Against an ideal real-valued scale, a power of two gives up at most one bit of range at the
top (entries use between M/2 and M), never precision: FP8's relative error does not depend on
the scale.

The error bound (`error_bound`): a value inside the normal range is off by at most half an
ulp, ``2**-(m+1)`` relative (m = 3 mantissa bits for e4m3, 2 for e5m2); below it, at most half
the smallest subnormal step times ``s``; a value past ``M * s`` saturates to ``+-M * s``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
Backend = Callable[..., torch.Tensor]  # an attention backend (tandem/models/attention.py)
_MIN_EXP, _MAX_EXP = -126, 126  # scales stay fp32 normals, and so do their inverses


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """``rollout.kv_dtype`` name -> the pool's torch dtype (a ValueError names the value)."""
    if kv_dtype not in FORMATS:
        raise ValueError(f"kv_dtype: expected one of {sorted(FORMATS)}, got {kv_dtype!r}")
    return FORMATS[kv_dtype]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp32_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32))


def scale_exponent(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k (int32) of the smallest ``2**k`` with ``amax <= fp8_max * 2**k``, in [-126, 126].

    Read off the fp32 bits, with no division or log (whose rounding could differ between
    PyTorch and a GPU): ``amax = a * 2**ea`` and ``M = m * 2**em`` with a, m in [1, 2) give
    ``k = ea - em + (a > m)``. The Triton store kernel does the same on the same bits."""
    bits = amax.float().contiguous().view(torch.int32)
    m_bits = fp32_bits(fp8_max(dtype))
    k = (
        ((bits >> 23) & 0xFF)
        - ((m_bits >> 23) & 0xFF)
        + ((bits & 0x7FFFFF) > (m_bits & 0x7FFFFF)).int()
    )
    return k.clamp(_MIN_EXP, _MAX_EXP)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` (fp32) for int32 k in [-126, 127], built from the bits (exact)."""
    return ((k + 127) << 23).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two scale (fp32) that maps ``amax`` into the format's range."""
    return exp2_int(scale_exponent(amax, dtype))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``round_fp8(clamp(x / scale))``: ``scale`` broadcasts against ``x`` (fp32 powers of two)."""
    m = fp8_max(dtype)
    return (x.float() * scale.reciprocal()).clamp_(-m, m).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32."""
    return q.float() * scale


def saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries of ``x`` past the range ``scale`` gives (they store as +-max), as a bool tensor."""
    return x.float().abs() * scale.reciprocal() > fp8_max(dtype)


def token_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token scales ``[..., H]`` of ``x [..., H, D]``: each (token, head) row's own amax."""
    return scale_from_amax(x.float().abs().amax(-1), dtype)


def fake_quant(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x [..., H, D]`` as the FP8 pool would give it back, in x's dtype; ``scale`` [H] (one
    per head) or None (per token, as `token_scales`). The gradient passes straight through
    (the rounding's derivative is taken as 1, saturated entries included)."""
    s = (
        token_scales(x, dtype)[..., None] if scale is None else scale[:, None]
    )  # [..., H, 1] or [H, 1]
    y = dequantize(quantize(x, s, dtype), s).to(x.dtype)
    return _StraightThrough.apply(x, y) if x.requires_grad else y


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):  # noqa: ANN001, ANN205
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``|dequantize(quantize(x)) - x|`` the format allows, per entry (fp32), for
    entries that do not saturate: half an ulp of the value, or half the subnormal step."""
    finfo = torch.finfo(dtype)
    m = MANTISSA_BITS[dtype]
    y = x.float().abs() * scale.reciprocal()
    exp = torch.floor(torch.log2(y.clamp(min=finfo.smallest_normal)))
    ulp = torch.exp2(
        exp - m
    )  # spacing of values in [2**exp, 2**(exp + 1)); subnormals: the min normal's
    return 0.5 * ulp * scale


class KVQuantAttention:
    """An attention backend wrapper (tandem/models/attention.py's seam): K and V go through the
    FP8 pool's rounding (`fake_quant`) before the wrapped backend attends over them. The
    update's forward runs this with the rollout's scales so it computes what the generator did.

    ``scales [L, 2, Hkv] fp32`` (the local KV heads of this rank) or None for per-token scales.
    """

    def __init__(self, inner: Backend, dtype: torch.dtype, scales: torch.Tensor | None) -> None:
        self.inner, self.dtype, self.scales = inner, dtype, scales

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        ks = vs = None
        if self.scales is not None:
            ks, vs = self.scales[layer_id, 0], self.scales[layer_id, 1]
        return self.inner(layer_id, q, fake_quant(k, self.dtype, ks), fake_quant(v, self.dtype, vs))


class KVAmaxObserver:
    """An attention backend wrapper that records, per layer, the largest ``|K|`` and ``|V|`` of
    each KV head it sees into ``amax [L, 2, H]`` (in place, a running max) at heads
    ``offset .. offset + local heads`` (a tensor-parallel rank holds a block of the heads),
    then calls the wrapped backend. ``mask [B, S]``: the positions that count (not padding)."""

    def __init__(
        self, inner: Backend, amax: torch.Tensor, offset: int = 0, mask: torch.Tensor | None = None
    ) -> None:
        self.inner, self.amax, self.offset, self.mask = inner, amax, offset, mask

    def _amax(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H, D] -> [H]
        a = x.detach().float().abs().amax(-1)  # [B, S, H]
        if self.mask is not None:
            a = a * self.mask[..., None]
        return a.amax(dim=(0, 1))

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        h = k.shape[-2]
        seen = torch.stack([self._amax(k), self._amax(v)])  # [2, h]
        part = self.amax[layer_id, :, self.offset : self.offset + h]
        torch.maximum(part, seen, out=part)
        return self.inner(layer_id, q, k, v)
