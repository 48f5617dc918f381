"""The attention-backend seam between the model and whoever schedules tokens.

The model computes q/k/v (after q/k-norm and RoPE) and hands them to a backend
``backend(layer_id, q [B,S,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,D]) -> [B,S,Hq,D]``.
Training uses `CausalAttention` (one sequence per row), `DocumentAttention`
(several documents packed into a row, one mask) or `SegmentAttention` (the same
packing, attended segment by segment without a mask); the generator plugs in a paged-KV
backend (tandem/rl/generator) that uses ``layer_id`` to find its cache. Scale is
``1/sqrt(head_dim)`` everywhere.

GPT-OSS layers also have attention sinks and sliding windows: `attend` then calls the backend
with ``sinks=`` and ``window=`` keywords, which only a backend whose ``sinks_and_windows``
attribute is True takes (the three training backends here and the generator's paged one);
any other backend is refused with one line naming it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.kernels import batch_invariant
from tandem.kernels.sink_attention import sink_attention, window_mask
from tandem.models.linear_attention import Segments, doc_segments, row_segments


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


def attend(
    backend: AttentionBackend,
    layer_id: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``backend(layer_id, q, k, v)``, with ``sinks`` / ``window`` passed on when the layer
    has them; ValueError when the backend cannot take them."""
    if sinks is None and window is None:
        return backend(layer_id, q, k, v)
    if not getattr(backend, "sinks_and_windows", False):
        raise ValueError(
            f"{type(backend).__name__} cannot run attention sinks or sliding windows "
            "(GPT-OSS layers); see the 'What composes' table in docs/config.md"
        )
    return backend(layer_id, q, k, v, sinks=sinks, window=window)


def _masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`sink_attention` on ``[B, S, H, D]`` layouts; ``allowed`` broadcasts to ``[B, H, S, S]``."""
    out = sink_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, sinks, q.shape[-1] ** -0.5
    )  # [B, Hq, S, D]
    return out.transpose(1, 2)  # [B, S, Hq, D]


def _window(allowed: torch.Tensor, window: int | None) -> torch.Tensor:
    """A causal mask ``[..., S, S]`` narrowed to a sliding window, measured in the positions
    the mask itself implies (a token's position is the number of keys it may see, minus one:
    a branch after a shared prompt counts from the prompt's end, not from its row index)."""
    if window is None:
        return allowed
    pos = allowed.sum(-1) - 1  # [..., S]
    return allowed & window_mask(pos, pos, window)


class CausalAttention:
    """Plain causal self-attention: every row of the batch is one sequence."""

    sinks_and_windows = True

    def linear_segments(self, b: int, s: int, device: torch.device) -> Segments:
        """Linear-attention layers (tandem/models/linear_attention.py): one sequence a row."""
        return row_segments(b, s, device)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        if sinks is None and window is None:
            return _sdpa(q, k, v, mask=None, causal=True)
        pos = torch.arange(q.shape[1], device=q.device)
        return _masked(q, k, v, window_mask(pos, pos, window), sinks)


class DocumentAttention:
    """Block-diagonal causal attention for packed rows.

    ``doc_ids [B, S]`` labels each token with its document; token i attends to
    token j iff ``j <= i`` and both carry the same id. Documents must be
    contiguous within a row. Padding may use id -1: a pad attends to earlier pads
    (never to real tokens), and every row keeps its diagonal, so nothing is NaN.
    The mask is built once per instance and shared by all layers (a sliding-window layer's
    narrower one too).

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
        self._windowed: dict[int, torch.Tensor] = {}
        self._segments: Segments | None = None

    sinks_and_windows = True

    def linear_segments(self, b: int, s: int, device: torch.device) -> Segments:
        """Linear-attention layers: each document, each branch after its prefix (built once)."""
        if self._segments is None:
            self._segments = doc_segments(self.doc_ids, self.branch_ids)
        return self._segments

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
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        mask = self.mask
        if window is not None:
            if window not in self._windowed:
                self._windowed[window] = _window(mask, window)
            mask = self._windowed[window]
        if sinks is None:
            return _sdpa(q, k, v, mask=mask, causal=False)
        return _masked(q, k, v, mask, sinks)


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

    sinks_and_windows = True

    def linear_segments(self, b: int, s: int, device: torch.device) -> Segments:
        """Linear-attention layers run the same segments (a shared prompt once per branch)."""
        return Segments(self.gather, self.scatter)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        b, s, hq, d = q.shape
        n, w = self.gather.shape
        idx = self.gather.reshape(-1)

        def segments(x: torch.Tensor) -> torch.Tensor:  # [B, S, H, D] -> [V, W, H, D]
            return x.reshape(b * s, x.shape[2], d).index_select(0, idx).view(n, w, x.shape[2], d)

        # each segment is one sequence in order: plain (windowed, sinked) causal attention
        out = CausalAttention()(layer_id, segments(q), segments(k), segments(v), sinks, window)
        return out.reshape(n * w, hq, d).index_select(0, self.scatter).view(b, s, hq, d)


class ExactAttention:
    """Batch-invariant attention (``rl.exact``): what `DocumentAttention` computes, each query
    over the keys its mask allows in row order, through `tandem.kernels.batch_invariant.attention`,
    the function the generator's paged attention uses too, so a token's output is the same
    bits in the training forward as in prefill or decode, whatever shares its batch. A
    sliding-window layer lists only the keys in its window; sinks join each denominator."""

    sinks_and_windows = True

    def __init__(self, doc_ids: torch.Tensor, branch_ids: torch.Tensor | None = None) -> None:
        self._docs = DocumentAttention(doc_ids, branch_ids)
        self._mask = self._docs.mask
        self.index, self.length = batch_invariant.mask_key_index(self._mask[:, 0])
        self._windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def linear_segments(self, b: int, s: int, device: torch.device) -> Segments:
        """Linear-attention layers: `DocumentAttention`'s segments."""
        return self._docs.linear_segments(b, s, device)

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        b, s, hq, d = q.shape
        index, length = self.index, self.length
        if window is not None:
            if window not in self._windowed:
                mask = _window(self._mask, window)[:, 0]
                self._windowed[window] = batch_invariant.mask_key_index(mask)
            index, length = self._windowed[window]
        out = batch_invariant.attention(
            q.reshape(b * s, hq, d),
            k.reshape(b * s, k.shape[2], d),
            v.reshape(b * s, v.shape[2], d),
            index,
            length,
            d**-0.5,
            sinks,
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
