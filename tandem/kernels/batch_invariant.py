"""Batch-invariant numerics (``rl.exact``): a row's result never depends on its neighbours.

The generator and the update run the same model on different batches, so any reduction
whose order depends on how many rows are processed together gives the two phases log-probs
that differ in the last bits. With `exact` on, the reducing operations take forms whose
order is fixed per row: matmuls in calls of ``TILE_ROWS`` rows (`tiled_mm`, or the Triton
kernel where `tandem.kernels.dispatch.use_triton` says Triton), attention and the
vocabulary's log-normaliser as fixed pairwise trees (`tree_sum`). The mode is process-wide,
like ``torch.use_deterministic_algorithms``. What each operation does on the CPU and CUDA,
and what was measured: docs/exactness.md.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from tandem import device as seam
from tandem.kernels.dispatch import use_triton

TILE_ROWS = 16  # rows per matmul call (see the module docstring)
# key positions gathered at a time in `attention` (memory only; values do not depend on it)
KEY_CHUNK = 64
QUERY_BLOCK = 256  # queries at a time in `attention` (memory only)
LANES = 64  # `lane_aligned`: a multiple of two vectors of any CPU's widest (64 bf16, AVX-512)

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton matmul takes

_state: dict[str, object] = {"lib": None}


def enabled() -> bool:
    return _state["lib"] is not None


def enable() -> None:
    """Switch batch-invariant matmuls on for this process (idempotent): aten ``mm`` and
    ``addmm`` on the CPU and, where CUDA is available, on CUDA; each call chooses the Triton
    kernel or `tiled_mm` as `tandem.kernels.dispatch.use_triton` says."""
    if enabled():
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
        warnings.simplefilter("ignore", UserWarning)
        for key in seam.dispatch_keys():
            lib.impl("mm", _mm, key)
            lib.impl("addmm", _addmm, key)
    _state["lib"] = lib


def disable() -> None:
    lib = _state["lib"]
    if lib is not None:
        lib._destroy()  # type: ignore[attr-defined]
        _state["lib"] = None


@contextlib.contextmanager
def exact_mode(on: bool = True) -> Iterator[None]:
    """``with exact_mode():`` batch-invariant numerics inside, the previous mode after."""
    was = enabled()
    enable() if on else disable()
    try:
        yield
    finally:
        enable() if was else disable()


# ---- matmul ---------------------------------------------------------------------------


def tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` in calls of exactly TILE_ROWS rows of ``a`` (aten ``mm.out``,
    which the override leaves alone)."""
    m = a.shape[0]
    out = a.new_empty(-(-m // TILE_ROWS) * TILE_ROWS, b.shape[1])  # [M', N]
    full = m - m % TILE_ROWS
    for s in range(0, full, TILE_ROWS):
        torch.ops.aten.mm.out(a[s : s + TILE_ROWS], b, out=out[s : s + TILE_ROWS])
    if full < m:
        tail = a.new_zeros(TILE_ROWS, a.shape[1])
        tail[: m - full] = a[full:]
        torch.ops.aten.mm.out(tail, b, out=out[full:])
    return out[:m]


def _triton_mm(a: torch.Tensor, b: torch.Tensor):  # noqa: ANN202 - module object or None
    """The Triton matmul's module when it should take ``a @ b`` (see `tandem.kernels.dispatch`),
    else None."""
    if a.dtype not in TRITON_DTYPES or b.dtype != a.dtype or not use_triton(a):
        return None
    from tandem.kernels import triton_batch_invariant  # Triton imported on first use

    return triton_batch_invariant


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    tk = _triton_mm(a, b)
    return tk.matmul(a, b) if tk is not None else tiled_mm(a, b)


def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    tk = _triton_mm(a, b)
    if tk is not None and bias.dtype == a.dtype:
        return tk.matmul(a, b, bias, alpha=alpha, beta=beta)  # bias added to the fp32 accumulator
    out = tiled_mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


# ---- reductions -----------------------------------------------------------------------


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by a fixed tree: zero-pad to a power of two, then add adjacent pairs
    until one is left. Zeros appended past the data change nothing (x + 0 == x), so the
    value depends on the entries alone, not on how far the row was padded."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = torch.nn.functional.pad(x, (0, size - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(z)))`` over the last dim, per row in a fixed order: [N, V] -> [N] (fp32)."""
    z = z.float()
    m = z.amax(-1, keepdim=True)  # a max is exact in any order
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return tree_sum((z - m).exp_()).log_() + m[..., 0]


# ---- attention ------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_index: torch.Tensor,
    key_len: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query over its own keys, in a fixed order that does not depend on the batch.

    q ``[T, Hq, D]``; k, v ``[N, Hkv, D]`` a store of key/value rows (a packed training
    batch, or the flattened paged cache); ``key_index [T, L]`` int64, query t's keys in
    position order in its first ``key_len[t]`` entries (the rest are ignored). Returns
    ``[T, Hq, D]`` in q's dtype; everything is computed in fp32. The Triton kernel
    (`tandem.kernels.triton_batch_invariant.attention`, the same trees fused) where
    `tandem.kernels.dispatch.use_triton` says so, else `attention_torch`. ``sinks [Hq]``
    (GPT-OSS): one more logit per head in each denominator, attending to nothing
    (`attention_torch` only).
    """
    if sinks is not None:
        return attention_torch(q, k, v, key_index, key_len, scale, sinks)
    if q.dtype in TRITON_DTYPES and use_triton(q):
        return _TritonAttention.apply(q, k, v, key_index, key_len, scale)
    return attention_torch(q, k, v, key_index, key_len, scale)


class _TritonAttention(torch.autograd.Function):
    """Forward by the Triton kernel; backward by autograd through `attention_torch` recomputed
    (the same function in another order: gradients to float rounding, which the exactness
    of log-probs does not need)."""

    @staticmethod
    def forward(ctx, q, k, v, key_index, key_len, scale):  # noqa: ANN001, ANN205
        from tandem.kernels import triton_batch_invariant

        ctx.save_for_backward(q, k, v, key_index, key_len)
        ctx.scale = scale
        return triton_batch_invariant.attention(q, k, v, key_index, key_len, scale).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, key_index, key_len = ctx.saved_tensors
        inputs = [
            t.detach().requires_grad_(need)
            for t, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)
        ]
        with torch.enable_grad():
            out = attention_torch(*inputs, key_index, key_len, ctx.scale)
            wrt = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, grad) if wrt else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_index: torch.Tensor,
    key_len: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention` in PyTorch: tree sums of gathered key chunks (any device)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    sink = None if sinks is None else sinks.float().view(hkv, hq // hkv)  # [Hkv, G]
    out = q.new_empty(t, hq, d)
    for s in range(0, t, QUERY_BLOCK):
        e = min(s + QUERY_BLOCK, t)
        out[s:e] = (
            _attend(
                q[s:e].float().view(e - s, hkv, hq // hkv, d),
                k,
                v,
                key_index[s:e],
                key_len[s:e],
                scale,
                sink,
            )
            .reshape(e - s, hq, d)
            .to(q.dtype)
        )
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One block of queries: q [T, Hkv, G, D] fp32 -> [T, Hkv, G, D]; ``sink [Hkv, G]``."""
    t = q.shape[0]
    width = int(length.max()) if t else 0
    chunks = [(c, min(c + KEY_CHUNK, width)) for c in range(0, width, KEY_CHUNK)]
    scores = []
    for c, e in chunks:  # scores [T, Hkv, G, C]: products, then a tree over D
        kc = k[index[:, c:e]].float().permute(0, 2, 1, 3)  # [T, Hkv, C, D]
        scores.append(tree_sum(q[:, :, :, None, :] * kc[:, :, None], dim=-1))
    s = torch.cat(scores, dim=-1) * scale  # [T, Hkv, G, L]
    valid = torch.arange(width, device=q.device)[None, :] < length[:, None]  # [T, L]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    top = s.amax(-1, keepdim=True)  # [T, Hkv, G, 1]
    if sink is not None:
        top = torch.maximum(top, sink[None, :, :, None])
    p = (s - top).exp_()  # [T, Hkv, G, L]; invalid keys exactly 0
    # sum_j p_j v_j: one tree over all key positions, taken chunk by chunk (a tree over a
    # power-of-two chunk, then over the chunks' sums, is the same adjacent-pair tree)
    parts = []
    for c, e in chunks:
        vc = v[index[:, c:e]].float().permute(0, 2, 1, 3)  # [T, Hkv, C, D]
        # [T, Hkv, G, KEY_CHUNK]
        pc = torch.nn.functional.pad(p[..., c:e], (0, KEY_CHUNK - (e - c)))
        vc = torch.nn.functional.pad(vc, (0, 0, 0, KEY_CHUNK - (e - c)))
        parts.append(tree_sum(pc[..., None] * vc[:, :, None], dim=-2))  # [T, Hkv, G, D]
    num = tree_sum(torch.stack(parts, dim=-1), dim=-1)  # [T, Hkv, G, D]
    den = tree_sum(p)  # [T, Hkv, G]
    if sink is not None:
        den = den + (sink[None] - top[..., 0]).exp()
    return num / den[..., None]


def paged_key_index(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_index [T, L], key_len [T])`` of a paged step's queries into the flattened cache
    (``[NB * BS, Hkv, D]``): query i of sequence n (position ``ctx - q_len + i``) attends to
    that sequence's slots 0..its position, in order."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [N]
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)  # [T]
    first = (cu_seqlens_q[:-1].long())[seq]
    # [T]
    pos = (
        context_lens.long()[seq] - q_lens[seq] + (torch.arange(len(seq), device=seq.device) - first)
    )
    width = int(context_lens.max()) if len(context_lens) else 0
    j = torch.arange(width, device=seq.device)  # [L]
    # [T, L]
    blocks = block_tables.long()[seq][:, (j // block_size).clamp(max=block_tables.shape[1] - 1)]
    index = blocks * block_size + j % block_size
    return index.masked_fill(j[None] > pos[:, None], 0), pos + 1


def mask_key_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_index [B*S, S], key_len [B*S])`` from an attention mask ``[B, S, S]`` (query
    i of row b attends to key j where True) into the flattened ``[B*S]`` key store, keys in
    row order."""
    b, s, _ = mask.shape
    j = torch.arange(s, device=mask.device)
    # allowed keys first, each group in row order
    order = torch.where(mask, j, s + j).argsort(dim=-1)
    index = (
        order.clamp(max=s - 1) + (torch.arange(b, device=mask.device) * s)[:, None, None]
    ).reshape(b * s, s)
    return index, mask.sum(-1).reshape(b * s)


# ---- elementwise functions ------------------------------------------------------------


def lane_aligned(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (exp, silu, softplus, sigmoid). With `exact` on, the
    last dim of every row is padded to a multiple of ``LANES`` first: on the CPU such an op
    runs whole vectors and then a scalar tail, whose results differ in the last bit for the
    transcendental ones (measured: silu and softplus), so where a token's values fall depends
    on how many rows share the tensor; padded, each row starts on a vector boundary and no
    tail is left (one thread's chunk: the op's ``grain_size`` of 32768 elements)."""
    if not enabled():
        return fn(x)
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    pad = -width % LANES
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return fn(flat)[:, :width].reshape(x.shape)
