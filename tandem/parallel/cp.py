"""Context parallelism: one packed row split over the ``cp`` ranks, attention across the split.

Every cp rank of a data-parallel rank holds the same micro-batch. Each takes its share of
the row's positions (`SequenceSplit`) and runs the whole model on it: embeddings, norms,
projections, MLPs and the log-prob head touch only local tokens, so their activations are
``S / cp`` per rank. Attention is the one place a token needs the others; the model's
attention seam (tandem/models/attention.py) takes a backend, and the two here are built
around the backend the unsplit row would use:

- `UlyssesAttention` (DeepSpeed-Ulysses): an all-to-all turns ``q, k, v [B, S/cp, H, D]``
  into ``[B, S, H/cp, D]`` (every position, this rank's heads), the unsplit row's own
  backend attends, and the reverse all-to-all brings the output back. cp must divide the
  query heads; when it does not divide the KV heads they are repeated first (each group of
  query heads keeps its KV head), so cp is not capped by the KV-head count. The split is
  contiguous.
- `tandem.parallel.ring_attention.RingAttention`: a zig-zag split into ``2 x cp`` chunks
  (rank r holds chunks r and 2cp-1-r, so causal work is balanced) and K/V passed around
  the ring while each rank's queries keep an online softmax; no head constraint.

Both take packed rows of any documents (document and shared-prompt branch ids, boundaries
anywhere) and give what the unsplit backend gives. Gradients flow back through the
collectives (the reverse all-to-all; the ring's backward passes K/V gradients around
again), so each rank's backward covers its own tokens' loss terms and FSDP2 over
``dp_shard x cp`` sums the shares (tandem/parallel/mesh.py).

The guard: a backend built here checks at every call that its input holds this rank's
share of the row, no more (a sequence that was never split, the silent no-op of verl
#7476) and no less, and counts its calls so the caller can check that the model's
attention went through it; `ContextParallel.effective` is the split it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.models.attention import AttentionBackend
from tandem.parallel.loss import all_reduce_sum
from tandem.parallel.ring_attention import RingAttention

STYLES = ("ulysses", "ring")


class ContextSplitError(RuntimeError):
    """An attention input that is not this rank's share of the row; str() is one line."""


@dataclass(frozen=True)
class SequenceSplit:
    """Which columns of a ``[B, S]`` row each of ``size`` ranks holds (``zigzag``: chunks r and
    2 size - 1 - r of 2 size; else chunk r of size), in local order."""

    seq_len: int
    size: int
    rank: int
    zigzag: bool

    def __post_init__(self) -> None:
        parts = 2 * self.size if self.zigzag else self.size
        if self.seq_len % parts:
            raise ValueError(
                f"a row of {self.seq_len} tokens does not split into {parts} equal chunks"
            )

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def chunks(self, rank: int | None = None) -> list[tuple[int, int]]:
        """Global column ranges ``[start, end)`` of ``rank`` (default: this rank), local order."""
        r = self.rank if rank is None else rank
        if not self.zigzag:
            c = self.seq_len // self.size
            return [(r * c, (r + 1) * c)]
        c = self.seq_len // (2 * self.size)
        return [(r * c, (r + 1) * c), ((2 * self.size - 1 - r) * c, (2 * self.size - r) * c)]

    def index(self, rank: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """``[S / size]`` global columns of ``rank``'s positions, in local order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks(rank)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of ``x`` along ``dim`` (the row's length there)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"expected {self.seq_len} positions along dim {dim}, got {tuple(x.shape)}"
            )
        parts = [x.narrow(dim, a, b - a) for a, b in self.chunks()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def local_columns(self, device: torch.device | None = None) -> torch.Tensor:
        """``[S]``: each global column's local position on this rank, -1 where another holds it."""
        out = torch.full((self.seq_len,), -1, dtype=torch.long, device=device)
        out[self.index(device=device)] = torch.arange(self.local_len, device=device)
        return out


class _Guard:
    """Counts a backend's calls and checks each input's length against this rank's share."""

    def __init__(self, split: SequenceSplit, owner: ContextParallel) -> None:
        self.split, self.owner, self.calls = split, owner, 0

    def check(self, q: torch.Tensor) -> None:
        s, n = self.split.seq_len, q.shape[1]
        if n != self.split.local_len:
            what = (
                "the whole row: the sequence was not split" if n == s else "not this rank's share"
            )
            raise ContextSplitError(
                f"context parallelism (cp={self.split.size}): rank {self.split.rank}'s attention "
                f"input holds {n} positions of a {s}-token row, {what} "
                f"(expected {self.split.local_len})"
            )
        self.calls += 1
        self.owner.effective = min(self.owner.effective, s / n) if self.owner.effective else s / n


class UlyssesAttention:
    """All-to-all q/k/v from sequence shards to head shards, the unsplit row's backend, and back."""

    def __init__(self, inner: AttentionBackend, group: dist.ProcessGroup, guard: _Guard) -> None:
        self.inner, self.group, self.guard = inner, group, guard
        self.size = dist.get_world_size(group)

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.guard.check(q)
        hq, hkv = q.shape[2], k.shape[2]
        rep = kv_repeats(hq, hkv, self.size)
        if rep > 1:  # each query head keeps its KV head: head j of the repeated set is j // rep
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        qf, kf, vf = (_SeqToHeads.apply(x, self.group) for x in (q, k, v))  # [B, S, H/cp, D]
        return _HeadsToSeq.apply(self.inner(layer_id, qf, kf, vf), self.group)  # [B, S/cp, Hq, D]


def kv_repeats(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each KV head so that cp divides them and every query
    head group still maps onto one: 1 when cp divides the KV heads."""
    if num_heads % cp:
        raise ValueError(
            f"ulysses splits the {num_heads} attention heads over cp={cp} ranks; "
            "cp must divide them (or use cp_style = 'ring')"
        )
    if num_kv_heads % cp == 0:
        return 1
    group = num_heads // num_kv_heads
    rep = cp // math.gcd(num_kv_heads, cp)
    return rep if group % rep == 0 else group


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, S/cp, H, D]`` (rank r: its contiguous shard) -> ``[B, S, H/cp, D]`` (head group r)."""
    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = (
        x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    )  # [cp, B, S/cp, H/cp, D]
    recv = torch.empty_like(send)  # [cp (source rank = sequence shard), B, S/cp, H/cp, D]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: ``[B, S, H/cp, D]`` -> ``[B, S/cp, H, D]``."""
    n = dist.get_world_size(group)
    b, s, h, d = y.shape
    send = (
        y.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    )  # [cp (dest), B, S/cp, H/cp, D]
    recv = torch.empty_like(send)  # [cp (source rank = head group), B, S/cp, H/cp, D]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _heads_to_seq(g.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore
        ctx.group = group
        return _heads_to_seq(y.contiguous(), group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _seq_to_heads(g.contiguous(), ctx.group), None


class ContextParallel:
    """This rank's cp group and style: splits rows, builds guarded attention backends, and
    sums per-token values over the group.

    ``group`` None is cp = 1 (nothing is split; `attention` returns the inner backend).
    ``effective``: the smallest ``S / local length`` the guards saw since `take_effective`.
    """

    def __init__(self, group: dist.ProcessGroup | None, style: str = "ulysses") -> None:
        if style not in STYLES:
            raise ValueError(f"cp_style must be one of {STYLES}, got {style!r}")
        self.group, self.style = group, style
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.effective = 0.0

    @property
    def granularity(self) -> int:
        """Row lengths must be multiples of this (ring: 2 x cp chunks; ulysses: cp)."""
        return 2 * self.size if self.style == "ring" else self.size

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """ValueError (one line) when the style cannot split these heads."""
        if self.style == "ulysses" and self.size > 1:
            kv_repeats(num_heads, num_kv_heads, self.size)

    def split(self, seq_len: int) -> SequenceSplit:
        return SequenceSplit(seq_len, self.size, self.rank, zigzag=self.style == "ring")

    def attention(
        self,
        split: SequenceSplit,
        inner: AttentionBackend,
        doc_ids: torch.Tensor,
        branch_ids: torch.Tensor | None = None,
    ) -> AttentionBackend:
        """The guarded backend for one row layout. ``inner`` attends the unsplit row (Ulysses);
        ``doc_ids`` / ``branch_ids [B, S]`` (of the unsplit row) are what the ring masks with,
        `tandem.models.attention.DocumentAttention`'s rule."""
        if self.group is None:
            return inner
        guard = _Guard(split, self)
        if self.style == "ulysses":
            return UlyssesAttention(inner, self.group, guard)
        return RingAttention(self.group, split, doc_ids, branch_ids, guard=guard)

    def sum_values(self, local: torch.Tensor, where: torch.Tensor, total: int) -> torch.Tensor:
        """``[total]`` values of which this rank computed ``local`` (at ``where``), the others
        theirs: placed in zeros and summed over the group, with an identity backward (every rank
        computes the same loss from the sum), so each rank's gradient reaches its own values."""
        full = local.new_zeros(total).index_put((where,), local)
        return full if self.group is None else all_reduce_sum(full, self.group)

    def take_effective(self) -> float:
        """The split measured since the last call (1.0 when nothing was split), then reset."""
        out, self.effective = self.effective or 1.0, 0.0
        return out
