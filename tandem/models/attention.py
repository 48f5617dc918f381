"""The attention-backend seam between the model and whoever schedules tokens.

The model computes q/k/v (after q/k-norm and RoPE) and hands them to a backend
``backend(layer_id, q [B,S,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,D]) -> [B,S,Hq,D]``.
Training uses `CausalAttention` (one sequence per row), `DocumentAttention`
(several documents packed into a row, one mask) or `SegmentAttention` (the same
packing, attended segment by segment without a mask); the generator plugs in a paged-KV
backend (tandem/rl/generator) that uses ``layer_id`` to find its cache. Scale is
``1/sqrt(head_dim)`` everywhere.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.kernels import batch_invariant


class AttentionBackend(Protocol):
    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """SDPA on ``[B, S, H, D]`` layouts with grouped-query heads.

    With an explicit mask, k/v heads are repeated instead of using ``enable_gqa``:
    the fused kernels that accept masks on CUDA do not all support ``enable_gqa``,
    and falling back to the math kernel would materialise the full score matrix.
    """
    group = q.shape[2] // k.shape[2]
    if mask is not None and group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [B, S, Hq, D]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
    out = F.scaled_dot_product_attention(
        qt,
        kt,
        vt,
        attn_mask=mask,
        is_causal=causal,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=qt.shape[1] != kt.shape[1],
    )  # [B, Hq, S, D]
    return out.transpose(1, 2)  # [B, S, Hq, D]


class CausalAttention:
    """Plain causal self-attention: every row of the batch is one sequence."""

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return _sdpa(q, k, v, mask=None, causal=True)


class DocumentAttention:
    """Block-diagonal causal attention for packed rows.

    ``doc_ids [B, S]`` labels each token with its document; token i attends to
    token j iff ``j <= i`` and both carry the same id. Documents must be
    contiguous within a row. Padding may use id -1: a pad attends to earlier pads
    (never to real tokens), and every row keeps its diagonal, so nothing is NaN.
    The mask is built once per instance and shared by all layers.

    Shared prefixes: with ``branch_ids [B, S]``, a document is a prefix (branch
    0) followed by branches 1, 2, ...; a branch token attends to the prefix and
    to earlier tokens of its own branch only, so each branch computes exactly
    what it would as ``prefix + branch`` alone (positions are the caller's).
    """

    def __init__(self, doc_ids: torch.Tensor, branch_ids: torch.Tensor | None = None) -> None:
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [B, S], got shape {tuple(doc_ids.shape)}")
        if branch_ids is not None and branch_ids.shape != doc_ids.shape:
            raise ValueError(
                f"branch_ids {tuple(branch_ids.shape)} must match doc_ids {tuple(doc_ids.shape)}"
            )
        self.doc_ids, self.branch_ids = doc_ids, branch_ids
        self._mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """Boolean ``[B, 1, S, S]``; True where attention is allowed."""
        if self._mask is None:
            d = self.doc_ids
            s = d.shape[1]
            same = d[:, :, None] == d[:, None, :]  # [B, S, S]
            if self.branch_ids is not None:
                br = self.branch_ids
                same &= (br[:, None, :] == 0) | (br[:, :, None] == br[:, None, :])
            causal = torch.ones(s, s, dtype=torch.bool, device=d.device).tril()  # [S, S]
            self._mask = (same & causal).unsqueeze(1)  # [B, 1, S, S]
        return self._mask

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return _sdpa(q, k, v, mask=self.mask, causal=False)


class SegmentAttention:
    """Causal attention over segments gathered out of a packed layout.

    ``gather [V, W]`` lists, per segment, the flat positions (into ``[B*S]``)
    of its tokens in order, padded at the end with any valid position;
    ``scatter [B*S]`` gives, per packed position, the flat position (into
    ``[V*W]``) whose output it takes. Each segment runs plain causal SDPA
    (the fused kernel, no mask tensor), so a token attends to the earlier
    tokens of its segment only, and padding, placed last, is never attended
    to by real tokens. The caller decides what a segment is: a packed
    document, or a shared prompt followed by one of its branches (the prompt
    then sits in several segments, its keys and values are read by each, and
    its own outputs are taken from one). This computes what
    `DocumentAttention` does at the cost of causal attention over the
    segments, which skips masked-out pairs instead of scoring them: a row
    holding a prompt and eight branches scores each branch against the prompt
    and itself only.
    """

    def __init__(self, gather: torch.Tensor, scatter: torch.Tensor) -> None:
        if gather.dim() != 2 or scatter.dim() != 1:
            raise ValueError(
                f"gather must be [V, W] and scatter [B*S], got {tuple(gather.shape)} and "
                f"{tuple(scatter.shape)}"
            )
        self.gather, self.scatter = gather, scatter

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, s, hq, d = q.shape
        n, w = self.gather.shape
        idx = self.gather.reshape(-1)

        def segments(x: torch.Tensor) -> torch.Tensor:  # [B, S, H, D] -> [V, W, H, D]
            return x.reshape(b * s, x.shape[2], d).index_select(0, idx).view(n, w, x.shape[2], d)

        out = _sdpa(segments(q), segments(k), segments(v), mask=None, causal=True)  # [V, W, Hq, D]
        return out.reshape(n * w, hq, d).index_select(0, self.scatter).view(b, s, hq, d)


class ExactAttention:
    """Batch-invariant attention (``rl.exact``): what `DocumentAttention` computes, each query
    over the keys its mask allows in row order, through `tandem.kernels.batch_invariant.attention`,
    the function the generator's paged attention uses too, so a token's output is the same
    bits in the training forward as in prefill or decode, whatever shares its batch."""

    def __init__(self, doc_ids: torch.Tensor, branch_ids: torch.Tensor | None = None) -> None:
        self.index, self.length = batch_invariant.mask_key_index(
            DocumentAttention(doc_ids, branch_ids).mask[:, 0]
        )

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, s, hq, d = q.shape
        out = batch_invariant.attention(
            q.reshape(b * s, hq, d),
            k.reshape(b * s, k.shape[2], d),
            v.reshape(b * s, v.shape[2], d),
            self.index,
            self.length,
            d**-0.5,
        )
        return out.view(b, s, hq, d)


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Per-document positions for a packed row: ``[B, S]`` doc ids -> ``[B, S]`` positions
    restarting at 0 at each document boundary (documents must be contiguous)."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)  # [B, S]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [B, S]
    return idx - start_idx
