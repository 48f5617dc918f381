"""Grouped GEMM for mixture-of-experts layers, and token permute / unpermute.

Dropless MoE dispatch sorts the ``T * k`` (token, expert) pairs by expert, so each expert
owns one contiguous run of rows (``offsets``: cumulative row counts, int32); one grouped
GEMM multiplies every run by its own expert's matrix, ``y[r] = x[r] @ w[e(r)]``.
`grouped_mm` is differentiable (its backward is another grouped GEMM and a per-expert
reduction) and takes the Triton kernels, ``torch._grouped_mm`` or a per-expert loop as
`tandem.kernels.dispatch` and ``rl.exact`` say; `grouped_mm_ref`, a loop of plain matmuls
through autograd, is the oracle. Which path runs where: docs/internals.md.
"""

from __future__ import annotations

import torch

from tandem import device as seam
from tandem.kernels import batch_invariant
from tandem.kernels.dispatch import use_triton


def _triton_impl():  # noqa: ANN202 - module object
    """Import the Triton kernels on first use (keeps Triton out of module import)."""
    from tandem.kernels import triton_grouped_gemm

    return triton_grouped_gemm


# ---------------------------------------------------------------------------
# Token permutation
# ---------------------------------------------------------------------------


def permute_tokens(
    expert_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``T * k`` (token, slot) pairs by expert; no host sync.

    Returns ``order`` ``[T * k]`` int64 (sorted position ``r`` holds the pair with
    flat index ``order[r]``, i.e. token ``order[r] // k``; ties keep token order, so
    the result is deterministic) and ``offsets`` ``[E]`` int32 (cumulative row
    counts per expert, the layout `grouped_mm` takes).
    """
    flat = expert_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], experts, right=True)  # [E]: rows with id <= e
    return order, offsets.to(torch.int32)


def unpermute_tokens(
    y_sorted: torch.Tensor,  # [T*k, N], rows in `order`
    order: torch.Tensor,  # [T*k] from permute_tokens
    weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, N]
    """Put expert outputs back in token order and combine: ``out[t] = sum_j w[t, j] y[t, j]``.

    A gather by the inverse permutation (each row written once: deterministic),
    then a weighted sum over the ``k`` slots in fp32, rounded to ``y``'s dtype.
    """
    t, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted[inverse].view(t, k, -1)  # [T, k, N]
    out = (y.float() * weights.float().unsqueeze(-1)).sum(dim=1)  # [T, N]
    return out.to(y_sorted.dtype)


# ---------------------------------------------------------------------------
# Grouped GEMM
# ---------------------------------------------------------------------------


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"expected x [M, K] and w [E, K, N]; got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] or offsets.dtype != torch.int32:
        raise ValueError(
            f"offsets must be int32 [E={w.shape[0]}]; got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if x.dtype != w.dtype or x.device != w.device or offsets.device != x.device:
        raise ValueError("x, w and offsets must share a device, and x and w a dtype")


def torch_grouped_mm_applies(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run this input (decided from dtype and device only)."""
    if not hasattr(torch, "_grouped_mm") or not x.is_floating_point():
        return False
    if x.device.type == "cpu":
        return True
    capability = seam.compute_capability(x.device)  # bf16 grouped GEMM: Hopper and later
    return capability is not None and x.dtype == torch.bfloat16 and capability >= (9, 0)


def _aligned(*ts: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: every non-unit stride and the data a multiple of 16 bytes
    (a LoRA rank of 3 in fp32 gives 12-byte rows: those go through the loop)."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
        for t in ts
    )


def grouped_mm(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [E, K, N]
    offsets: torch.Tensor,  # [E] int32, cumulative
    *,
    impl: str | None = None,
) -> torch.Tensor:  # [M, N]
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` times ``w[e]``; differentiable in x and w.

    Rows at or past ``offsets[-1]`` are unspecified (dropless dispatch covers all).
    ``impl`` forces ``"triton"`` or ``"torch"`` (see `tandem.kernels.dispatch`).
    """
    _check(x, w, offsets)
    return _GroupedMM.apply(x, w, offsets, use_triton(x, impl))


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, triton):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w, offsets)
        ctx.triton = triton
        return _forward(x, w, offsets, triton)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()  # see the module docstring: _grouped_mm rejects expanded grads
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _forward(dy, w.transpose(1, 2), offsets, ctx.triton)  # [M, K]
        if ctx.needs_input_grad[1]:
            if w.stride(1) == 1 and w.stride(2) != 1:  # w is a transposed [E, N, K] parameter:
                # compute its gradient in that layout, so autograd need not copy it back.
                dw = _weight_grad(dy, x, offsets, ctx.triton).transpose(1, 2)  # [E, K, N] view
            else:
                dw = _weight_grad(x, dy, offsets, ctx.triton)  # [E, K, N]
        return dx, dw, None, None


def _forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, triton: bool) -> torch.Tensor:
    if batch_invariant.enabled():
        # rl.exact: one matmul per expert, which the mode runs in fixed-shape row tiles (or the
        # Triton batch-invariant matmul), so a row's result does not depend on how many rows its
        # expert got in this batch (torch._grouped_mm's does: the generator and the update
        # differed in the last bits; the Triton kernel here sizes its tiles from rows / experts)
        with torch.no_grad():
            return grouped_mm_ref(x, w, offsets)
    if triton:
        return _triton_impl().grouped_mm(x, w, offsets)
    if torch_grouped_mm_applies(x) and _aligned(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    with torch.no_grad():
        return grouped_mm_ref(x, w, offsets)


def _weight_grad(
    x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, triton: bool
) -> torch.Tensor:
    """``dw[e] = x_e^T @ dy_e`` over expert ``e``'s rows; zero for an expert with none."""
    if triton:
        return _triton_impl().grouped_weight_grad(x, dy, offsets)
    if torch_grouped_mm_applies(x) and _aligned(x, dy):
        return torch._grouped_mm(x.t(), dy, offs=offsets)  # 2-D x 2-D: ragged reduction dim
    bounds = [0, *offsets.tolist()]  # deliberate host sync (fallback path only)
    return torch.stack([x[s:e].t() @ dy[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The oracle: a loop of ``x_e @ w[e]`` over the runs (host sync to read ``offsets``);
    autograd-differentiable, and the fair per-expert loop bench/moe.py times.

    Rows past ``offsets[-1]`` are zero here.
    """
    _check(x, w, offsets)
    ends = offsets.tolist()
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends)] + [x.shape[0] - ends[-1]]
    # split and unbind, not x[s:e] and w[i]: each slice's backward would materialise a zero
    # gradient as large as the whole x (or w); split's backward concatenates the parts once.
    *runs, rest = x.split(sizes)
    parts = [run @ we for run, we in zip(runs, w.unbind(0), strict=True)]
    return torch.cat([*parts, rest.new_zeros(rest.shape[0], w.shape[2])])
