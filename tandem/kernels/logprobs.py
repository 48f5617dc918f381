"""Per-token log-probs and entropy straight from hidden states, without the ``[T, V]`` logits.

RL losses need ``log_softmax(h @ W.T)[target]`` and the entropy per token; the obvious code
keeps several fp32 ``[T, V]`` tensors (2.5 GB each at T = 4096, V = 151936) alive until
backward. Here only the per-token logsumexp and entropy are saved and backward recomputes
the logits: chunked over tokens in PyTorch, or a Triton kernel that keeps them in registers.
Memory, gradients, numerics and the kernels' design: docs/internals.md. The kernels sit in
this module (``triton.jit`` needs module-level functions), so importing it imports Triton
when installed; set ``TRITON_INTERPRET=1`` before that to run them on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem import device as seam
from tandem.kernels import batch_invariant
from tandem.kernels.dispatch import triton_interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path works without Triton
    triton = None

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["token_logprobs_entropy", "token_logprobs_entropy_reference"]


def token_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    with_entropy: bool = True,
    chunk_tokens: int = 1024,
    impl: str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log p(target)`` and entropy of ``softmax(hidden @ weight.T)``.

    Args:
        hidden: ``[T, D]`` final hidden states (fp32, bf16 or fp16; fp64 on the
            torch path only, computed and returned in fp64, for gradcheck).
        weight: ``[V, D]`` output projection (LM head), same dtype as ``hidden``.
        targets: ``[T]`` int64 token ids in ``[0, V)`` (not checked: a host sync).
        with_entropy: also return the entropy (else ``None``; slightly cheaper).
        chunk_tokens: tokens per chunk on the torch path (peak ~ 2 * chunk * V * 4 B).
        impl: ``"torch"`` or ``"triton"`` to force an implementation (or
            the process's `tandem.kernels.dispatch.set_kernels`); ``None`` takes Triton on CUDA
            and the chunked torch path elsewhere. On an H200 (T=4096, V=151936,
            D=2048, bf16, forward + backward) Triton took 23 ms at 2.1 GB peak, the
            chunked path 45 ms at 2.7 GB, naive full logits 31 ms at 11.9 GB.

    Returns:
        ``(logp [T] fp32, entropy [T] fp32 or None)``, both differentiable with
        respect to ``hidden`` and ``weight``.
    """
    # rl.exact takes the chunked path whatever the device: its logits go through the
    # batch-invariant matmul and its normaliser is the sampler's (the Triton kernel splits V
    # over a number of programs chosen from T, `_num_splits`)
    triton_path = use_triton(hidden, impl) and not batch_invariant.enabled()  # validates impl first
    _check_args(hidden, weight, targets, chunk_tokens)
    if triton_path:
        if hidden.dtype not in _TRITON_DTYPES:
            raise ValueError(f"the Triton path takes {_TRITON_DTYPES}, not {hidden.dtype}")
        out = _TritonLogprobs.apply(hidden, weight, targets, with_entropy, chunk_tokens)
    else:
        out = _ChunkedLogprobs.apply(hidden, weight, targets, with_entropy, chunk_tokens)
    return (out[0], out[1]) if with_entropy else (out, None)


def token_logprobs_entropy_reference(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Naive version materialising ``[T, V]`` fp32 logits; for tests and benchmarks."""
    logp_all = torch.log_softmax((hidden @ weight.T).float(), dim=-1)  # [T, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def _check_args(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, D] and weight [V, D], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ValueError(
            f"expected int64 targets of shape [{hidden.shape[0]}], got "
            f"{targets.dtype} {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")


# ---------------------------------------------------------------------------
# Chunked PyTorch path
# ---------------------------------------------------------------------------


def _chunk_logp_all(h: Tensor, weight: Tensor, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``log_softmax`` of one chunk's logits, in place in the fp32 logits buffer.

    Returns ``(logp_all [C, V] fp32, lse [C])``; ``lse`` is recomputed unless given.
    """
    z = (h @ weight.T).to(_acc_dtype(h))  # [C, V]
    if lse is None:  # rl.exact: the sampler's batch-invariant normaliser
        # [C]
        lse = (
            batch_invariant.logsumexp(z)
            if batch_invariant.enabled()
            else torch.logsumexp(z, dim=-1)
        )
    return z.sub_(lse[:, None]), lse


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (so `torch.autograd.gradcheck` can check the path)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _ChunkedLogprobs(torch.autograd.Function):
    """Token-chunked forward/backward saving only ``[T]`` statistics, not logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, with_entropy, chunk_tokens):
        T = hidden.shape[0]
        acc = _acc_dtype(hidden)
        logp = hidden.new_empty(T, dtype=acc)
        lse = hidden.new_empty(T, dtype=acc)
        entropy = hidden.new_empty(T, dtype=acc) if with_entropy else None
        for s in range(0, T, chunk_tokens):
            e = min(s + chunk_tokens, T)
            logp_all, lse_c = _chunk_logp_all(hidden[s:e], weight)  # [C, V], [C]
            lse[s:e] = lse_c
            logp[s:e] = logp_all.gather(-1, targets[s:e, None]).squeeze(-1)
            if with_entropy:
                entropy[s:e] = logp_all.exp().mul_(logp_all).sum(-1).neg_()
            del logp_all
        ctx.with_entropy, ctx.chunk_tokens = with_entropy, chunk_tokens
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator over chunks; cast to weight's dtype at the end.
        acc = {"dtype": _acc_dtype(weight), "device": weight.device}
        grad_w = torch.zeros(weight.shape, **acc) if need_w else None
        T = hidden.shape[0]
        use_ent = ctx.with_entropy and g_entropy is not None
        for s in range(0, T, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, T)
            h = hidden[s:e]  # [C, D]
            logp_all, _ = _chunk_logp_all(h, weight, lse[s:e])  # [C, V]
            gl = g_logp[s:e, None]  # [C, 1]
            # dz = g_logp * onehot - p * (g_logp + g_H * (log p + H)), built in place.
            p = logp_all.exp()
            if use_ent:
                dz = logp_all.add_(entropy[s:e, None]).mul_(g_entropy[s:e, None]).add_(gl)
            else:
                dz = logp_all.copy_(gl.expand_as(logp_all))
            dz = dz.mul_(p).neg_()
            del p
            dz.scatter_add_(-1, targets[s:e, None], gl)
            dz = dz.to(hidden.dtype)
            if need_h:
                grad_h[s:e] = dz @ weight
            if need_w:
                if grad_w.dtype == h.dtype:
                    grad_w.addmm_(dz.T, h)  # no [V, D] temporary
                else:
                    grad_w += dz.T @ h  # bf16/fp16 product into the fp32 accumulator
            del dz, logp_all
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


# ---------------------------------------------------------------------------
# Triton path
# ---------------------------------------------------------------------------

if triton is not None:
    # fmt: off

    @triton.jit
    def _logit_tile(
        h_ptr, w_ptr, rows, cols, stride_h, stride_w, T, V,
        D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """fp32 logits ``h[rows] @ w[cols].T`` as a [BLOCK_T, BLOCK_V] tile."""
        z = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            h = tl.load(h_ptr + rows[:, None] * stride_h + d[None, :],
                        mask=(rows[:, None] < T) & (d[None, :] < D), other=0.0)  # [BT, BD]
            w = tl.load(w_ptr + cols[:, None] * stride_w + d[None, :],
                        mask=(cols[:, None] < V) & (d[None, :] < D), other=0.0)  # [BV, BD]
            z = tl.dot(h, tl.trans(w), z, input_precision=PRECISION)
        return z

    @triton.jit
    def _fwd_kernel(
        h_ptr, w_ptr, tgt_ptr, part_ptr,
        stride_h, stride_w, T, V, NSPLIT, PLANE,
        D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (token block, vocab split): online sums over the split's vocab tiles.

        Writes the split's partial ``(m, s, a, z_target)`` to ``part[k, split, row]``
        (``PLANE = NSPLIT * T`` elements per ``k``); `_merge_splits` combines the splits.
        """
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        split = tl.program_id(1).to(tl.int64)
        row_ok = rows < T
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0)  # [BT]
        per_split = tl.cdiv(tl.cdiv(V, NSPLIT), BLOCK_V) * BLOCK_V  # whole tiles per split
        v_lo = split * per_split
        v_hi = tl.minimum(v_lo + per_split, V)
        # Finite start for m: (m_old - m_new) * s stays 0 * finite on the first tile.
        m = tl.full((BLOCK_T,), -1e30, dtype=tl.float32)
        s = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - m)
        a = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
        zt = tl.zeros((BLOCK_T,), dtype=tl.float32)  # target logit (0 unless in this split)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # [BV]
            z = _logit_tile(h_ptr, w_ptr, rows, cols, stride_h, stride_w, T, V,
                            D, BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
            col_ok = cols[None, :] < v_hi
            z = tl.where(col_ok, z, float("-inf"))
            zt += tl.sum(tl.where((cols[None, :] == tgt[:, None]) & col_ok, z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(z - m_new[:, None])  # 0 at masked columns
            if WITH_ENTROPY:
                pz = p * tl.where(col_ok, z - m_new[:, None], 0.0)  # no 0 * -inf
                a = alpha * (a + s * (m - m_new)) + tl.sum(pz, axis=1)
            s = s * alpha + tl.sum(p, axis=1)
            m = m_new
        out = part_ptr + split * T + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + PLANE, s, mask=row_ok)
        tl.store(out + 2 * PLANE, a, mask=row_ok)
        tl.store(out + 3 * PLANE, zt, mask=row_ok)

    @triton.jit
    def _dz_kernel(
        h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dz_ptr,
        stride_h, stride_w, T, V,
        D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (token block, vocab tile): recompute its logits and write
        ``dz = g_logp * onehot - p * (g_logp + g_H * (log p + H))`` in the input dtype."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
        row_ok = rows < T
        col_ok = cols < V
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        gl = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        z = _logit_tile(h_ptr, w_ptr, rows, cols, stride_h, stride_w, T, V,
                        D, BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
        logp = z - lse[:, None]  # [BT, BV]
        p = tl.exp(logp)
        coef = gl[:, None] + tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        if WITH_ENTROPY:
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            ge = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
            coef += ge[:, None] * (logp + ent[:, None])
        dz = tl.where(cols[None, :] == tgt[:, None], gl[:, None], 0.0) - p * coef
        tl.store(dz_ptr + rows[:, None] * V + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    # fmt: on


def _tiles(hidden: Tensor) -> dict[str, object]:
    """Tile sizes, warps and dot precision: tiny tiles under the interpreter, GPU-sized on CUDA."""
    if hidden.device.type == "cpu" and triton_interpreting():
        tiles = {"BLOCK_T": 16, "BLOCK_V": 16, "BLOCK_D": 16}
    elif hidden.dtype == torch.float32:  # untimed: fp32 logits are rare on GPUs
        tiles = {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 32, "num_warps": 4, "num_stages": 3}
    else:
        # bf16 on an H200 at T=4096, V=151936, D=2048, forward + backward: 22.9 ms against
        # 25.5 ms for 128 x 128 tiles and 25.7-26.6 ms for three others (bench/logprobs_memory.py).
        tiles = {"BLOCK_T": 128, "BLOCK_V": 256, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}
    tiles["PRECISION"] = "ieee" if hidden.dtype == torch.float32 else "tf32"
    return tiles


def _num_splits(hidden: Tensor, T: int, V: int, block_t: int, block_v: int) -> int:
    """Vocab splits for the forward: enough programs for about four per multiprocessor."""
    if hidden.device.type == "cpu":
        return min(2, triton.cdiv(V, block_v))  # the interpreter: exercise the merge cheaply
    sms = seam.multiprocessor_count(hidden.device)
    want = triton.cdiv(4 * sms, max(1, triton.cdiv(T, block_t)))
    return max(1, min(want, triton.cdiv(V, block_v)))


def _merge_splits(part: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(logp, lse, entropy)`` from per-split ``(m, s, a, z_target)``, each ``[NSPLIT, T]``.

    Rescaling split ``i`` to the common max ``M``: ``s = sum_i s_i e^(m_i - M)`` and
    ``a = sum_i e^(m_i - M) (a_i + s_i (m_i - M))``, where ``a`` is the sum of
    ``e^(z - M) (z - M)``.
    """
    m, s, a, zt = part.unbind(0)
    big = m.amax(0)  # [T]
    shift = m - big  # <= 0
    scale = shift.exp()
    s_tot = (s * scale).sum(0)
    log_s = s_tot.log()
    lse = big + log_s
    logp = zt.sum(0) - lse
    entropy = None
    if with_entropy:
        a_tot = (scale * (a + s * shift)).sum(0)
        entropy = log_s - a_tot / s_tot
    return logp, lse, entropy


class _TritonLogprobs(torch.autograd.Function):
    """Triton forward (logits never leave registers) and a backward that writes one chunk's
    logit gradients in the input dtype straight from recomputed logits, then takes the two
    products with the library's matmul; saves only ``[T]`` statistics besides the inputs."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, with_entropy, chunk_tokens):
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        (T, D), V = hidden.shape, weight.shape[0]
        tiles = _tiles(hidden)
        nsplit = _num_splits(hidden, T, V, tiles["BLOCK_T"], tiles["BLOCK_V"])
        part = hidden.new_empty(4, nsplit, T, dtype=torch.float32)
        grid = (triton.cdiv(T, tiles["BLOCK_T"]), nsplit)
        if T:  # an empty micro-batch (kept so that ranks stay in step) launches nothing
            _fwd_kernel[grid](
                hidden, weight, targets, part, hidden.stride(0), weight.stride(0), T, V, nsplit,
                nsplit * T, D=D, WITH_ENTROPY=with_entropy, **tiles,
            )  # fmt: skip
        logp, lse, entropy = _merge_splits(part, with_entropy)
        ctx.with_entropy, ctx.chunk_tokens = with_entropy, chunk_tokens
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        (T, D), V = hidden.shape, weight.shape[0]
        use_ent = ctx.with_entropy and g_entropy is not None
        g_logp = g_logp.float().contiguous()
        g_ent = g_entropy.float().contiguous() if use_ent else g_logp
        ent = entropy if use_ent else lse  # a dummy pointer when unused
        tiles = _tiles(hidden)
        chunk = max(1, min(ctx.chunk_tokens, T))
        dz = hidden.new_empty(chunk, V)  # the input dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w and chunk < T:  # several chunks: accumulate in fp32 (fp64 never gets here)
            grad_w = torch.zeros(V, D, dtype=torch.float32, device=weight.device)
        elif need_w and T == 0:
            grad_w = torch.zeros_like(weight)
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            dz_c = dz[: e - s]
            grid = (triton.cdiv(e - s, tiles["BLOCK_T"]), triton.cdiv(V, tiles["BLOCK_V"]))
            _dz_kernel[grid](
                hidden[s:e], weight, targets[s:e], lse[s:e], ent[s:e], g_logp[s:e], g_ent[s:e],
                dz_c, hidden.stride(0), weight.stride(0), e - s, V,
                D=D, WITH_ENTROPY=use_ent, **tiles,
            )  # fmt: skip
            if need_h:
                torch.mm(dz_c, weight, out=grad_h[s:e])
            if need_w:
                if grad_w is None:
                    grad_w = dz_c.T @ hidden[s:e]  # one chunk: straight into the input dtype
                elif grad_w.dtype == hidden.dtype:
                    grad_w.addmm_(dz_c.T, hidden[s:e])
                else:
                    grad_w += dz_c.T @ hidden[s:e]
        del dz
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
        )
