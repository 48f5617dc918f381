"""Triton kernels for ``rl.exact``: the matmul ``c = a @ b (* alpha + beta * bias)``, each row
computed in an order that does not depend on how many rows there are, and the exact
attention's fixed trees fused into one kernel (see the comment above `attention`).

Called through `tandem.kernels.batch_invariant` (its aten ``mm`` / ``addmm`` override and
its `attention`), which chooses between these kernels and the PyTorch references. Imports
Triton at the top, so that module imports this one lazily; under ``TRITON_INTERPRET=1``
it runs on the CPU. Why a row's result is independent of the batch (fixed tiles per dtype,
no split-K) and what the interpreter changes: docs/exactness.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.dispatch import triton_interpreting

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
        # [BM, BK]
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [BK, BN]
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRETED:  # the same order in every row (see the module docstring)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN] fp32
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm.to(tl.int64)[:, None] * stride_biasm
                       + rn[None, :] * stride_biasn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc = acc * alpha + bias.to(tl.float32) * beta
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# fmt: on


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
) -> torch.Tensor:
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
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), full.stride(0), full.stride(1),
        c.stride(0), c.stride(1), float(alpha), float(beta),
        HAS_BIAS=bias is not None, INTERPRETED=triton_interpreting(),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    # fmt: on
    return c


# ---- attention --------------------------------------------------------------------------------
# `tandem.kernels.batch_invariant.attention`'s trees, fused: one program per (query, KV head) walks
# the query's own keys in KEY_CHUNK chunks, twice (the max, then the sums). Within a chunk the sums
# over the head dim and over key positions are adjacent-pair trees (`_tree2`, `_tree3`: split the
# last axis into pairs and add them, log2(n) times), as in `tree_sum`; across chunks the sums are
# combined by the same adjacent-pair tree, kept as a binary counter (`_push`, `_total`): a stack
# of partial sums, level l holding the sum of 2**l chunks. That equals the tree over the chunk
# sums zero-padded to a power of two, so a query's result depends on its own keys alone.

KEY_CHUNK = 32  # keys per step; values do not depend on it (a power of two), spills do:
ATTN_WARPS = 8  # ptxas for sm_90 (bf16, 2 query heads per KV head, D = 128): 32 keys and 8 warps,
# 218 registers and no spills; 64 keys spilled ~200 bytes at 255 registers with 4 or 8 warps


@triton.jit
def _tree2(x, LOG2: tl.constexpr):
    """Adjacent-pair tree over the last axis (2**LOG2 long) of [A, N]: [A]."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = a + b
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def _tree3(x, LOG2: tl.constexpr):
    """Adjacent-pair tree over the last axis (2**LOG2 long) of [A, B, N]: [A, B]."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 2, 2)))
        x = a + b
    return tl.reshape(x, (x.shape[0], x.shape[1]))


@triton.jit
def _chunk_scores(
    q,
    k_ptr,
    idx_row,
    c0,
    n_keys,
    stride_kn,
    stride_kd,
    d,
    d_ok,
    scale,
    KC: tl.constexpr,
    LOG2_D: tl.constexpr,
):
    """Scores [G, KC] of the query's heads against keys c0..c0+KC (-inf past its keys)."""
    c = c0 + tl.arange(0, KC)
    ok = c < n_keys
    rows = tl.load(idx_row + c, mask=ok, other=0)  # [KC] int64 rows of the key store
    k = tl.load(
        k_ptr + rows[:, None] * stride_kn + d[None, :] * stride_kd,
        mask=ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [KC, D]
    s = _tree3(q[:, None, :] * k[None, :, :], LOG2_D) * scale  # [G, KC]
    return tl.where(ok[None, :], s, float("-inf")), rows, ok


@triton.jit
def _level2(stack, at):
    """Entry ``at`` ([LEVELS] one-hot) of a stack [LEVELS, G]; adding zeros is exact."""
    return tl.sum(tl.where(at[:, None], stack, 0.0), axis=0)


@triton.jit
def _level3(stack, at):
    """Entry ``at`` of a stack [LEVELS, G, D]."""
    return tl.sum(tl.where(at[:, None, None], stack, 0.0), axis=0)


@triton.jit
def _push(stack_n, stack_d, part_n, part_d, i, levels, LEVELS: tl.constexpr):
    """Add chunk ``i``'s sums to the binary counter: merge with each full level (bit set in i)
    up from level 0, then place the carry at the first empty one."""
    carrying = i >= 0
    for lv in tl.static_range(LEVELS):
        at = levels == lv
        full = ((i >> lv) & 1) == 1
        merge = carrying & full
        part_n = tl.where(merge, _level3(stack_n, at) + part_n, part_n)
        part_d = tl.where(merge, _level2(stack_d, at) + part_d, part_d)
        place = at & (carrying & (((i >> lv) & 1) == 0))
        stack_n = tl.where(place[:, None, None], part_n[None], stack_n)
        stack_d = tl.where(place[:, None], part_d[None], stack_d)
        carrying = merge
    return stack_n, stack_d


@triton.jit
def _total(stack_n, stack_d, n, levels, LEVELS: tl.constexpr):
    """The counter's sum over ``n`` chunks: its levels (the set bits of n), lowest first."""
    num = _level3(stack_n, levels < 0)  # no level: zeros [G, D]
    den = _level2(stack_d, levels < 0)
    seen = n < 0
    for lv in tl.static_range(LEVELS):
        at = levels == lv
        full = ((n >> lv) & 1) == 1
        num = tl.where(full, tl.where(seen, _level3(stack_n, at) + num, _level3(stack_n, at)), num)
        den = tl.where(full, tl.where(seen, _level2(stack_d, at) + den, _level2(stack_d, at)), den)
        seen = seen | full
    return num, den


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    len_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_it,
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    G,
    D,
    G_P: tl.constexpr,
    D_P: tl.constexpr,
    KC: tl.constexpr,
    LEVELS: tl.constexpr,
    LOG2_D: tl.constexpr,
    LOG2_KC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    g_ok = g < G
    d_ok = d < D
    n_keys = tl.load(len_ptr + t).to(tl.int32)
    qm = g_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=qm,
        other=0.0,
    ).to(tl.float32)  # [G, D]
    idx_row = idx_ptr + t * stride_it
    k_base = k_ptr + h * stride_kh
    m = tl.full((G_P,), float("-inf"), tl.float32)
    for c0 in range(0, n_keys, KC):  # the max over all the query's keys (exact in any order)
        s, _, _ = _chunk_scores(
            q, k_base, idx_row, c0, n_keys, stride_kn, stride_kd, d, d_ok, scale, KC, LOG2_D
        )
        m = tl.maximum(m, tl.max(s, axis=1))
    levels = tl.arange(0, LEVELS)
    stack_n = tl.zeros((LEVELS, G_P, D_P), tl.float32)
    stack_d = tl.zeros((LEVELS, G_P), tl.float32)
    i = n_keys * 0
    for c0 in range(0, n_keys, KC):
        s, rows, ok = _chunk_scores(
            q, k_base, idx_row, c0, n_keys, stride_kn, stride_kd, d, d_ok, scale, KC, LOG2_D
        )
        p = tl.exp(s - m[:, None])  # [G, KC]; 0 past the keys
        v = tl.load(
            v_ptr + h * stride_vh + rows[:, None] * stride_vn + d[None, :] * stride_vd,
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [KC, D]
        pv = tl.permute(p[:, :, None] * v[None, :, :], (0, 2, 1))  # [G, D, KC]
        stack_n, stack_d = _push(
            stack_n, stack_d, _tree3(pv, LOG2_KC), _tree2(p, LOG2_KC), i, levels, LEVELS
        )
        i += 1
    num, den = _total(stack_n, stack_d, i, levels, LEVELS)
    out = num / den[:, None]  # [G, D]
    tl.store(
        out_ptr + t * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :] * stride_od,
        out,
        mask=qm,
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_index: torch.Tensor,
    key_len: torch.Tensor,
    scale: float,
    chunk: int = KEY_CHUNK,
) -> torch.Tensor:
    """`tandem.kernels.batch_invariant.attention`'s contract (q [T, Hq, D]; k, v [N, Hkv,
    D]; key_index [T, L]; key_len [T]); returns [T, Hq, D] in fp32, the caller casts. Forward
    only. ``chunk`` (a power of two) changes the speed, not the values."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    chunks = max(1, triton.cdiv(key_index.shape[1], chunk))
    # the counter's depth: registers, not values
    levels = triton.next_power_of_2(chunks.bit_length())
    d_p = triton.next_power_of_2(d)
    # fmt: off
    _attention_kernel[(t, hkv)](
        q, k, v, key_index, key_len, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
        v.stride(1), v.stride(2), key_index.stride(0), out.stride(0), out.stride(1), out.stride(2),
        float(scale), hq // hkv, d,
        G_P=triton.next_power_of_2(hq // hkv), D_P=d_p, KC=chunk, LEVELS=levels,
        LOG2_D=d_p.bit_length() - 1, LOG2_KC=chunk.bit_length() - 1, num_warps=ATTN_WARPS,
    )
    # fmt: on
    return out
