"""Attention with sinks and sliding windows (GPT-OSS), in plain PyTorch.

A sink is one learned logit per query head that joins every softmax's denominator and
attends to nothing: ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})``, so a head may
put part of its attention nowhere. A sliding window of ``W`` lets a query at position ``i``
see keys ``i - W < j <= i`` only. `sink_attention` is the one formula both the training
backends (tandem/models/attention.py) and the generator's paged path
(`paged_sink_attention`, over the pages of tandem/kernels/paged_attention.py) run. It is
eager (the scores are materialised), the reference a fused kernel would be checked against;
no Triton kernel exists yet. The order of operations is the released model's eager one
(scores, mask, the sink column appended, the row max subtracted, softmax, the sink column
dropped), so fp32 logits agree with transformers to rounding. Under ``rl.exact``
`paged_sink_attention_exact` runs `tandem.kernels.batch_invariant.attention` over the keys
in the window instead, the function the update's `ExactAttention` runs.
"""

from __future__ import annotations

import torch

from tandem.kernels import batch_invariant
from tandem.kernels.paged_attention_torch import gather_kv


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., Lq, Lk]`` bool: key position ``<=`` query position and, with a window, within
    it. ``q_pos [..., Lq]``, ``k_pos [..., Lk]``."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # [..., Lq, Lk]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def sink_attention(
    q: torch.Tensor,  # [B, Hq, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    allowed: torch.Tensor,  # bool, broadcastable to [B, Hq, Lq, Lk]
    sinks: torch.Tensor | None,  # [Hq] or None
    scale: float,
) -> torch.Tensor:  # [B, Hq, Lq, D]
    """Masked softmax attention with an optional sink logit per head (see the module
    docstring). A row that allows no key gets zeros without a sink, and zeros too with one
    (all of its weight on the sink)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, Hq, Lq, Lk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)  # [B, Hq, Lq, Lk + 1]
    scores = scores - scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's share attends to nothing
    return torch.matmul(probs.to(v.dtype), v)  # [B, Hq, Lq, D]


def paged_sink_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB]
    cu_seqlens_q: torch.Tensor,  # [N + 1]
    context_lens: torch.Tensor,  # [N]
    scale: float,
    sinks: torch.Tensor | None,  # [Hq]
    window: int | None,
) -> torch.Tensor:  # [T, Hq, D]
    """`tandem.kernels.paged_attention.paged_attention`'s contract (sequence ``n``'s queries
    are its last ``q_len`` positions of ``context_lens[n]``) with sinks and a sliding window:
    per sequence, its pages gathered, then `sink_attention`. Keys that left the window are
    still read from their pages (masked); freeing them is the paged pool's follow-up work."""
    out = torch.zeros_like(q)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()  # one host sync per layer
    for n, ctx in enumerate(ctx_lens):
        lo, hi = cu[n], cu[n + 1]
        if hi == lo or ctx == 0:
            continue
        k = gather_kv(k_cache, block_tables[n], ctx).to(q.dtype)  # [C, Hkv, D]
        v = gather_kv(v_cache, block_tables[n], ctx).to(q.dtype)
        k_pos = torch.arange(ctx, device=q.device)
        q_pos = k_pos[ctx - (hi - lo) :]  # [L]
        allowed = window_mask(q_pos, k_pos, window)  # [L, C]
        o = sink_attention(
            q[lo:hi].transpose(0, 1)[None],  # [1, Hq, L, D]
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            allowed,
            sinks,
            scale,
        )  # [1, Hq, L, D]
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def paged_sink_attention_exact(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [N, MB]
    cu_seqlens_q: torch.Tensor,  # [N + 1]
    context_lens: torch.Tensor,  # [N]
    scale: float,
    sinks: torch.Tensor | None,  # [Hq]
    window: int | None,
) -> torch.Tensor:  # [T, Hq, D]
    """`paged_sink_attention` through the batch-invariant attention (``rl.exact``): each query's
    key list is its sequence's slots from the window's start to its position, in order, which
    is the list `tandem.models.attention.ExactAttention` builds from the training mask (rows
    past the step's queries are zero; one host sync for the query count)."""
    out = torch.zeros_like(q)
    t = int(cu_seqlens_q[-1])
    if t == 0:
        return out
    bs = k_cache.shape[1]
    index, length = batch_invariant.paged_key_index(block_tables, cu_seqlens_q, context_lens, bs)
    if window is not None:  # drop the keys before the window: shift each row's list left
        start = (length - window).clamp(min=0)  # [T]
        j = torch.arange(index.shape[1], device=index.device)
        index = index.gather(1, (j[None] + start[:, None]).clamp(max=index.shape[1] - 1))
        length = length - start
    out[:t] = batch_invariant.attention(
        q[:t], k_cache.flatten(0, 1), v_cache.flatten(0, 1), index, length, scale, sinks
    )
    return out
