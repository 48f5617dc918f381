"""Paged-KV attention for the generator: public API and dispatcher.

The generator keeps, per layer, a K and a V cache of fixed-size blocks,
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``; a sequence's block table lists the block ids
that hold its positions ``0, block_size, 2*block_size, ...`` in order (the ids
need not be contiguous or sorted).

Each step the runner first writes the new tokens' K/V with `store_kv`, then calls
`paged_attention` for a batch that may mix prefill (no cached prefix), extend
(cached prefix plus several new tokens) and decode (one new token) sequences.
Query ``i`` of sequence ``n`` sits at position ``context_lens[n] - q_len[n] + i``
and attends to every cache position up to and including its own.
`paged_decode_attention` is the all-decode case with its own kernel.

The Triton kernels live in `tandem.kernels.triton_paged_attention` and are imported on
first use, so this module imports without Triton; `tandem.kernels.dispatch.use_triton`
picks the implementation. The PyTorch paths live in `tandem.kernels.paged_attention_torch`:
the loop references (they sync; the numerics oracle for the kernels) and the CPU path,
`paged_attention_torch`: the same math batched over sequences (every sequence's pages
gathered into one padded tensor, one masked softmax), tested against the loop reference.

FP8 caches (`tandem.kernels.kv_quant`): ``k_cache``/``v_cache`` in ``float8_e4m3fn`` or
``float8_e5m2`` with fp32 power-of-two scales, ``k_scale``/``v_scale``: either one per KV
head (``[Hkv]``, calibrated; `store_kv` divides by it) or one per cache slot and KV head
(``[NB, BS, Hkv]``, which `store_kv` writes from each entry's own amax). Every attention
path dequantizes what it reads (``fp8 * scale`` in fp32) and then computes exactly what it
computes on a cache holding those dequantized values.
"""

from __future__ import annotations

import torch

from tandem.kernels import batch_invariant
from tandem.kernels import kv_quant as kvq
from tandem.kernels.dispatch import use_triton
from tandem.kernels.paged_attention_torch import (
    TorchPlan,
    dequantize_pages,
    paged_attention_torch,
    store_kv_ref,
)

_INDEX_DTYPES = (torch.int32, torch.int64)


def _triton_impl():  # noqa: ANN202 - module object
    """Import the Triton kernels on first use (keeps Triton out of module import)."""
    from tandem.kernels import triton_paged_attention

    return triton_paged_attention


# ---------------------------------------------------------------------------
# Argument checks (shape / dtype only: no host syncs)
# ---------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")


def _check_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """An FP8 cache needs both scales ([Hkv] per head or [NB, BS, Hkv] per slot, fp32); any
    other cache none."""
    fp8 = k_cache.dtype in kvq.MANTISSA_BITS
    if (k_scale is None) != (v_scale is None) or fp8 != (k_scale is not None):
        need = "both" if fp8 else "no"
        raise ValueError(f"a {k_cache.dtype} cache takes {need} k_scale and v_scale")
    if not fp8:
        return
    shapes = (tuple(k_cache.shape[2:3]), tuple(k_cache.shape[:3]))
    for t in (k_scale, v_scale):
        if tuple(t.shape) not in shapes or t.dtype != torch.float32 or t.device != k_cache.device:
            raise ValueError(
                f"k_scale / v_scale must be fp32 {list(shapes[0])} (per KV head) or "
                f"{list(shapes[1])} (per slot) on the cache's device; "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if k_scale.shape != v_scale.shape:
        raise ValueError("k_scale and v_scale must have the same shape")


def _check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim or t.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"{name} must be a {dim}-d int32/int64 tensor; got {t.dtype} {tuple(t.shape)}"
        )


def _check_query(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    _, _, hkv, d = k_cache.shape
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv != 0:
        raise ValueError(
            f"q must be [T, Hq, {d}] with Hq a multiple of num_kv_heads={hkv}; got {tuple(q.shape)}"
        )
    if q.device != k_cache.device:
        raise ValueError("q and the KV cache must be on the same device")


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = skip
    *,
    impl: str | None = None,
    k_scale: torch.Tensor | None = None,  # FP8 caches: [Hkv] (read) or [NB, BS, Hkv] (written)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token ``t``'s K/V into cache slot ``slot_mapping[t]`` in place; -1 skips the token.

    Padding tokens (e.g. unused rows of a CUDA-graph batch) carry slot -1. ``k``/``v``
    are cast to the cache dtype, or quantized into an FP8 cache (`tandem.kernels.kv_quant`):
    divided by the head's scale, or, with per-slot scales, by the power of two that the
    entry's own amax over ``D`` gives, which is written to the scale's slot.
    """
    _check_cache(k_cache, v_cache)
    _check_scales(k_cache, k_scale, v_scale)
    _check_index("slot_mapping", slot_mapping, 1)
    expected = (slot_mapping.shape[0], *k_cache.shape[2:])
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"k and v must be {expected}; got {tuple(k.shape)} and {tuple(v.shape)}")
    if use_triton(k, impl):
        _triton_impl().store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB] int32
    cu_seqlens_q: torch.Tensor,  # [N + 1] int32
    context_lens: torch.Tensor,  # [N] int32
    scale: float,
    *,
    impl: str | None = None,
    max_q_len: int | None = None,
    plan: TorchPlan | None = None,
    k_scale: torch.Tensor | None = None,  # FP8 caches: [Hkv] or [NB, BS, Hkv] fp32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a mixed prefill / extend / decode batch over the paged cache.

    ``q[cu_seqlens_q[n]:cu_seqlens_q[n+1]]`` are sequence ``n``'s new queries, whose
    K/V are already in the cache; ``context_lens[n]`` counts all its cached tokens,
    new ones included. Sequences with no queries are allowed. Output rows past
    ``cu_seqlens_q[-1]`` are unspecified.

    ``max_q_len`` (the largest ``q_len``) sizes the Triton grid; pass it when the
    host knows it, otherwise it is read from ``cu_seqlens_q`` with one device sync.
    ``max_q_len == 1`` with one query per sequence routes to the decode kernel.
    ``plan``: the step's `plan_torch` metadata for the PyTorch path (ignored by Triton).
    ``k_scale``/``v_scale``: an FP8 cache's scales (see the module docstring).
    """
    _check_cache(k_cache, v_cache)
    _check_scales(k_cache, k_scale, v_scale)
    _check_query(q, k_cache)
    _check_index("block_tables", block_tables, 2)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1)
    _check_index("context_lens", context_lens, 1)
    n = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != n + 1 or block_tables.shape[0] != n:
        raise ValueError(
            f"expected cu_seqlens_q [{n + 1}] and block_tables [{n}, MB] for {n} sequences; "
            f"got {tuple(cu_seqlens_q.shape)} and {tuple(block_tables.shape)}"
        )
    if batch_invariant.enabled():  # rl.exact: the training forward's attention function
        return _paged_attention_exact(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale, v_scale
        )
    if not use_triton(q, impl):
        return paged_attention_torch(
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            context_lens,
            scale,
            max_q_len,
            plan,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    tk = _triton_impl()
    if max_q_len == 1 and q.shape[0] == n:
        return tk.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=k_scale, v_scale=v_scale
        )
    if max_q_len is None:
        # Deliberate host sync: the grid needs the longest query run.
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if n > 0 else 0
    return tk.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        max_q_len,
        k_scale,
        v_scale,
    )


def _paged_attention_exact(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` through `tandem.kernels.batch_invariant.attention` (rows past the step's
    queries are zero); one host sync for the query count. An FP8 cache's blocks that the step
    reads are dequantized into a compact store first (the same values, fewer of them)."""
    out = torch.zeros_like(q)
    t = int(cu_seqlens_q[-1])
    if t == 0:
        return out
    if k_scale is not None:
        # [U] blocks read, and the tables renumbered into them
        used, block_tables = torch.unique(block_tables.long().clamp(min=0), return_inverse=True)
        k_cache = dequantize_pages(k_cache, k_scale, used)
        v_cache = dequantize_pages(v_cache, v_scale, used)
    index, length = batch_invariant.paged_key_index(
        block_tables, cu_seqlens_q, context_lens, k_cache.shape[1]
    )
    out[:t] = batch_invariant.attention(
        q[:t], k_cache.flatten(0, 1), v_cache.flatten(0, 1), index, length, scale
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB] int32
    context_lens: torch.Tensor,  # [N] int32
    scale: float,
    *,
    impl: str | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,  # FP8 caches: [Hkv] or [NB, BS, Hkv] fp32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, Hq, D]
    """One new query per sequence (at position ``context_lens[n] - 1``); no host syncs.

    A sequence with ``context_lens[n] == 0`` (a padded decode row) gets a zero output.
    ``num_splits`` splits each sequence's KV range across programs (split-K) on the
    Triton path; None picks it from the batch size and ``block_tables`` width.
    """
    _check_cache(k_cache, v_cache)
    _check_scales(k_cache, k_scale, v_scale)
    _check_query(q, k_cache)
    _check_index("block_tables", block_tables, 2)
    _check_index("context_lens", context_lens, 1)
    n = q.shape[0]
    if context_lens.shape[0] != n or block_tables.shape[0] != n:
        raise ValueError(
            f"expected context_lens [{n}] and block_tables [{n}, MB]; "
            f"got {tuple(context_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if use_triton(q, impl):
        return _triton_impl().paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            num_splits=num_splits,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    cu = torch.arange(n + 1, dtype=torch.int32, device=q.device)  # [N + 1]
    return paged_attention_torch(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu,
        context_lens,
        scale,
        1,
        k_scale=k_scale,
        v_scale=v_scale,
    )
