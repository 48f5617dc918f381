"""Triton kernels for the paged KV cache: store, prefill/extend attention, decode attention.

Called only through `tandem.kernels.paged_attention`, which checks arguments, picks between
these kernels and the PyTorch reference, and holds the semantics. This module imports
Triton at the top, so that one imports it lazily; under ``TRITON_INTERPRET=1`` (set before
this module is imported) the kernels run on the CPU. Design (tiles independent of the
block size, grouped-query heads packed per tile, online base-2 softmax, split-K decode
without host syncs): docs/internals.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import device as seam
from tandem.kernels import kv_quant as kvq

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------
# Kernels (parameters grouped by role: pointers, strides, constexprs)
# ---------------------------------------------------------------------------
# fmt: off


@triton.jit
def _pow2_scale(amax, M_EXP: tl.constexpr, M_MANT: tl.constexpr):
    """(scale, 1 / scale): the smallest power of two 2**k with amax <= fp8 max * 2**k, k in
    [-126, 126], from the fp32 bits (`tandem.kernels.kv_quant.scale_exponent`)."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - M_EXP + ((bits & 0x7FFFFF) > M_MANT).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 126)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    return scale, ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """y (fp32, within the format's range) rounded to the FP8 grid, to nearest, ties to even, in
    fp32: ``(|y| + C) - C`` with C a power of two whose fp32 spacing is the grid's spacing at
    y (EMIN: the biased fp32 exponent of the format's smallest normal; MANT: its mantissa
    bits). The cast to FP8 is then exact, so it does not matter how the cast rounds (the
    interpreter's rounds 7.84 to 4 in e4m3)."""
    a = tl.abs(y)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, EMIN)
    c = ((e - MANT + 23) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(y < 0, -r, r)


@triton.jit
def _store_rows(
    x, c_ptr, s_ptr, dst, mask, s_dst, h_ok, inv_head,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, M_EXP: tl.constexpr, M_MANT: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr,
):
    """Store one token's [H, D] rows at ``dst``: cast, or quantized with ``inv_head`` [H]
    (QUANT 1) or with the rows' own scales, written at ``s_dst`` [H] (QUANT 2)."""
    if QUANT == 0:
        tl.store(c_ptr + dst, x.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        y = x.to(tl.float32)
        if QUANT == 1:
            y = y * inv_head[:, None]
        else:
            s, inv = _pow2_scale(tl.max(tl.abs(y), 1), M_EXP, M_MANT)  # [H]
            tl.store(s_ptr + s_dst, s, mask=h_ok)
            y = y * inv[:, None]
        y = _round_fp8(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), MANT, EMIN)
        tl.store(c_ptr + dst, y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, M_EXP: tl.constexpr, M_MANT: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr,
):
    """One program per token: copy its [Hkv, D] K and V rows into the cache slot (quantized
    into an FP8 cache: ``ks``/``vs`` hold inverse scales [Hkv] for QUANT 1, and the slot
    scales [NB, BS, Hkv] that this kernel writes for QUANT 2)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # A skipped slot (-1) masks every head. (Folded into the bound rather than and-ed
    # in as a scalar: the interpreter mistypes `tensor & scalar_bool`.)
    num_heads = tl.where(slot >= 0, NUM_HEADS, 0)
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)  # [H, D]
    safe = tl.maximum(slot, 0)
    dst = (safe // PAGE) * stride_cb + (safe % PAGE) * stride_cs  # scalar
    dst = dst + h[:, None] * stride_ch + d[None, :]  # [H, D]
    s_dst = safe * NUM_HEADS + h  # [H] into the slot scales [NB * BS, Hkv]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    inv_k = tl.full([BLOCK_H], 1.0, tl.float32)
    inv_v = inv_k
    if QUANT == 1:
        inv_k = tl.load(ks_ptr + h, mask=h < NUM_HEADS, other=1.0)
        inv_v = tl.load(vs_ptr + h, mask=h < NUM_HEADS, other=1.0)
    _store_rows(k, kc_ptr, ks_ptr, dst, mask, s_dst, h_ok, inv_k,
                QUANT, FP8_MAX, M_EXP, M_MANT, MANT, EMIN)
    _store_rows(v, vc_ptr, vs_ptr, dst, mask, s_dst, h_ok, inv_v,
                QUANT, FP8_MAX, M_EXP, M_MANT, MANT, EMIN)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, start, kv_hi, pos, d, kv_head_off,
    qk_scale, stride_cb, stride_cs, ks_ptr, vs_ptr, k_head_scale, v_head_scale, kvh,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    """One online-softmax step over KV positions [start, start + BLOCK_N) below ``kv_hi``.

    q [M, D]; m_i, l_i [M]; acc [M, D]; pos [M] query positions (used when CAUSAL).
    FP8 tiles are dequantized: by the head's scale (QUANT 1) or each slot's (QUANT 2,
    ``ks``/``vs`` [NB * BS, Hkv]).
    """
    j = start + tl.arange(0, BLOCK_N)  # [N] cache positions
    j_ok = j < kv_hi
    d_ok = d < HEAD_DIM
    bid = tl.load(bt_row_ptr + j // PAGE, mask=j_ok, other=0).to(tl.int64)  # [N]
    kv_off = bid * stride_cb + (j % PAGE) * stride_cs + kv_head_off  # [N]
    s_off = (bid * PAGE + j % PAGE) * NUM_KV_HEADS + kvh  # [N] into the slot scales
    k_mask = j_ok[None, :] & d_ok[:, None]
    k = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=k_mask, other=0.0)  # [D, N]
    if QUANT == 1:
        k = k.to(tl.float32) * k_head_scale
    if QUANT == 2:
        k = k.to(tl.float32) * tl.load(ks_ptr + s_off, mask=j_ok, other=0.0)[None, :]
    k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [M, N], log2 domain
    keep = j_ok[None, :]
    if CAUSAL:
        keep = keep & (j[None, :] <= pos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    alpha = tl.exp2(m_i - m_new)  # [M]
    p = tl.exp2(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v_mask = j_ok[:, None] & d_ok[None, :]
    v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=v_mask, other=0.0)  # [N, D]
    if QUANT == 1:
        v = v.to(tl.float32) * v_head_scale
    if QUANT == 2:
        v = v.to(tl.float32) * tl.load(vs_ptr + s_off, mask=j_ok, other=0.0)[:, None]
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _head_scales(ks_ptr, vs_ptr, kvh, QUANT: tl.constexpr):
    """The KV head's K and V scales (QUANT 1), else 1."""
    ks = 1.0
    vs = 1.0
    if QUANT == 1:
        ks = tl.load(ks_ptr + kvh)
        vs = tl.load(vs_ptr + kvh)
    return ks, vs


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, cu_ptr, ctx_ptr, ks_ptr, vs_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, TOK_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    """Grid (sequence, query tile, kv head). Rows are (token, head-in-group) pairs."""
    n = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_lo = tl.load(cu_ptr + n)
    q_len = tl.load(cu_ptr + n + 1) - q_lo
    ctx = tl.load(ctx_ptr + n)
    prefix = ctx - q_len  # cached tokens before the new ones

    r = tl.arange(0, BLOCK_M)
    tok0 = tile * TOK_PER_TILE
    tok = tok0 + r // GROUP  # [M] query index within the sequence
    head = kvh * GROUP + r % GROUP  # [M] query head
    row_ok = (r < TOK_PER_TILE * GROUP) & (tok < q_len)
    pos = prefix + tok  # [M] absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]  # [M, D]
    row = (q_lo + tok).to(tl.int64)  # [M]
    q_off = row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]  # [M, D]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)

    # Causal limit of the whole tile: its last live query's position + 1 (0 for an empty tile).
    kv_hi = tl.minimum(ctx, prefix + tok0 + TOK_PER_TILE)
    kv_hi = tl.where(tok0 < q_len, kv_hi, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + n.to(tl.int64) * stride_bt
    k_head_scale, v_head_scale = _head_scales(ks_ptr, vs_ptr, kvh, QUANT)
    for start in range(0, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, start, kv_hi, pos, d, kvh * stride_ch,
            qk_scale, stride_cb, stride_cs, ks_ptr, vs_ptr, k_head_scale, v_head_scale, kvh,
            HEAD_DIM, PAGE, BLOCK_N, True, PRECISION, QUANT, NUM_KV_HEADS,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, part_o_ptr, part_m_ptr, part_l_ptr, bt_ptr, ctx_ptr,
    ks_ptr, vs_ptr,
    qk_scale, split_len, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    """Grid (sequence, kv head, split). Rows are the kv head's group of query heads.

    Without SPLIT the normalised output goes to ``o``; with SPLIT the unnormalised
    accumulator and its (max, sum) go to the partial buffers ``[N, Hq, S, ...]``.
    """
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + n)
    g = tl.arange(0, BLOCK_G)
    head = kvh * GROUP + g  # [G]
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    io_mask = g_ok[:, None] & (d[None, :] < HEAD_DIM)  # [G, D]
    n64 = n.to(tl.int64)
    q_off = n64 * stride_qt + head[:, None] * stride_qh + d[None, :]  # [G, D]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)

    lo = sp * split_len
    hi = tl.minimum(ctx, lo + split_len)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + n64 * stride_bt
    k_head_scale, v_head_scale = _head_scales(ks_ptr, vs_ptr, kvh, QUANT)
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, start, hi, g, d, kvh * stride_ch,
            qk_scale, stride_cb, stride_cs, ks_ptr, vs_ptr, k_head_scale, v_head_scale, kvh,
            HEAD_DIM, PAGE, BLOCK_N, False, PRECISION, QUANT, NUM_KV_HEADS,
        )
    if SPLIT:
        # part_* are contiguous: m, l [N, Hq, S]; o [N, Hq, S, BLOCK_D].
        ml_off = (n64 * (GROUP * tl.num_programs(1)) + head) * num_splits + sp  # [G]
        tl.store(part_m_ptr + ml_off, m_i, mask=g_ok)
        tl.store(part_l_ptr + ml_off, l_i, mask=g_ok)
        tl.store(part_o_ptr + ml_off[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = n64 * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    o_ptr, part_o_ptr, part_m_ptr, part_l_ptr, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (sequence, query head): merge the split-K partials into the output row."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    base = (n * tl.num_programs(1) + h) * num_splits  # first partial of this (n, h)
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))  # [S]
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)  # [S] softmax sums
    o_part = part_o_ptr + (base + s)[:, None] * BLOCK_D + d[None, :]
    o = tl.load(o_part, mask=s_ok[:, None], other=0.0)  # [S, D]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: all weights 0
    w = tl.exp2(m - m_max)  # [S]
    l_tot = tl.sum(l_s * w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(l_tot > 0, l_tot, 1.0)  # [D]
    o_row = o_ptr + n * stride_ot + h * stride_oh + d
    tl.store(o_row, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# fmt: on
# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_cache_layout(cache: torch.Tensor) -> None:
    if cache.stride(-1) != 1:
        raise ValueError("KV cache must be contiguous in head_dim (it is written in place)")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _quant_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(QUANT, k scales, v scales) for the kernels: 0 and placeholders for an unquantized
    cache, 1 and the per-head scales, 2 and the per-slot scales (made contiguous)."""
    if k_scale is None:
        return 0, k_cache, k_cache
    if k_scale.dim() == 1:
        return 1, k_scale.contiguous(), v_scale.contiguous()
    if not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("per-slot KV scales must be contiguous (they are written in place)")
    return 2, k_scale, v_scale


def _fp8_constants(dtype: torch.dtype) -> dict[str, object]:
    """FP8_MAX, the fp32 exponent and mantissa bits of it (`_pow2_scale`), the format's mantissa
    bits and the fp32 exponent of its smallest normal (`_round_fp8`); placeholders otherwise."""
    if dtype not in kvq.MANTISSA_BITS:
        return {"FP8_MAX": 0.0, "M_EXP": 0, "M_MANT": 0, "MANT": 0, "EMIN": 0}
    m = kvq.fp8_max(dtype)
    bits = kvq.fp32_bits(m)
    emin = (kvq.fp32_bits(torch.finfo(dtype).smallest_normal) >> 23) & 0xFF
    return {
        "FP8_MAX": m,
        "M_EXP": (bits >> 23) & 0xFF,
        "M_MANT": bits & 0x7FFFFF,
        "MANT": kvq.MANTISSA_BITS[dtype],
        "EMIN": emin,
    }


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton `store_kv` (arguments already checked by the caller)."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    _check_cache_layout(k_cache)
    _check_cache_layout(v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _, page, hkv, d = k_cache.shape
    quant, ks, vs = _quant_args(k_cache, k_scale, v_scale)
    if quant == 1:  # the kernel multiplies by the inverse (exact for powers of two)
        ks, vs = ks.reciprocal(), vs.reciprocal()
    # fmt: off
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=hkv, HEAD_DIM=d, PAGE=page,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        QUANT=quant, **_fp8_constants(k_cache.dtype),
    )
    # fmt: on


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB]
    cu_seqlens_q: torch.Tensor,  # [N + 1]
    context_lens: torch.Tensor,  # [N]
    scale: float,
    max_q_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton prefill / extend attention (arguments already checked by the caller)."""
    q = _last_dim_contiguous(q)
    _check_cache_layout(k_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    out = torch.empty_like(q)  # [T, Hq, D]
    n = context_lens.shape[0]
    _, page, hkv, d = k_cache.shape
    group = q.shape[1] // hkv
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(64, triton.next_power_of_2(group))
    block_n = 64 if block_d <= 64 else 32
    tok_per_tile = block_m // group
    num_tiles = triton.cdiv(max_q_len, tok_per_tile)
    if n == 0 or num_tiles == 0:
        return out
    block_tables = block_tables.contiguous()
    quant, ks, vs = _quant_args(k_cache, k_scale, v_scale)
    # fmt: off
    _prefill_kernel[(n, num_tiles, hkv)](
        q, k_cache, v_cache, out,
        block_tables, cu_seqlens_q.contiguous(), context_lens.contiguous(), ks, vs,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, TOK_PER_TILE=tok_per_tile, HEAD_DIM=d, PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_precision(q.dtype),
        QUANT=quant, NUM_KV_HEADS=hkv, num_warps=4, num_stages=2,
    )
    # fmt: on
    return out


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device, block_n: int
) -> int:
    """Split-K factor for decode, from shapes only (no device reads).

    Split only when ``num_seqs * num_kv_heads`` programs would leave most SMs idle,
    and keep every split at least 4 KV tiles long so the merge stays cheap.
    """
    if not seam.triton_supported(device):
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * seam.multiprocessor_count(device)
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, max(programs, 1))
    by_length = max(1, max_context // (4 * block_n))
    return max(1, min(by_occupancy, by_length, 64))


def paged_decode_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB]
    context_lens: torch.Tensor,  # [N]
    scale: float,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, Hq, D]
    """Triton decode attention, optionally split-K (arguments already checked by the caller)."""
    q = _last_dim_contiguous(q)
    _check_cache_layout(k_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    out = torch.empty_like(q)  # [N, Hq, D]
    n, hq, _ = q.shape
    _, page, hkv, d = k_cache.shape
    if n == 0:
        return out
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    block_g = max(16, triton.next_power_of_2(group))
    block_n = 64 if block_d <= 64 else 32
    max_context = block_tables.shape[1] * page  # upper bound from the shape: no sync
    if num_splits is None:
        num_splits = choose_num_splits(n, hkv, max_context, q.device, block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(max_context, block_n)))
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    split = num_splits > 1
    if split:
        part_o = torch.empty(n, hq, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_m = torch.empty(n, hq, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty(n, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_m = part_l = out  # unused by the kernel when SPLIT is False
    block_tables = block_tables.contiguous()
    quant, ks, vs = _quant_args(k_cache, k_scale, v_scale)
    # fmt: off
    _decode_kernel[(n, hkv, num_splits)](
        q, k_cache, v_cache, out, part_o, part_m, part_l,
        block_tables, context_lens.contiguous(), ks, vs,
        scale * _LOG2E, split_len, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, PAGE=page,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLIT=split, PRECISION=_precision(q.dtype), QUANT=quant, NUM_KV_HEADS=hkv,
        num_warps=4, num_stages=2,
    )
    if split:
        _merge_splits_kernel[(n, hq)](
            out, part_o, part_m, part_l, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    # fmt: on
    return out
