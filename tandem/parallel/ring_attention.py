"""Ring attention over packed rows: each rank's queries, every rank's K/V passed around the ring.

Rank r holds chunks r and 2cp-1-r of the row's ``2 x cp`` equal chunks (the zig-zag split
of `tandem.parallel.cp.SequenceSplit`), so under causal masking every rank has the same
work. At step s it holds the K/V of rank ``r - s`` (sent on to ``r + 1`` while it computes)
and folds their scores into an online softmax per query (running max ``m``, sum ``lsum`` and
output accumulator, fp32), as flash attention does across key tiles; after ``cp`` steps
``out = acc / lsum`` and ``lse = m + log lsum``. Which key may be read is
`tandem.models.attention.DocumentAttention`'s rule on the unsplit row: the same document,
not a later column, and with shared prompts the prefix or the query's own branch; so any
packing of documents attends as it would unsplit.

Work is tiled: a tile of ``tile_q`` queries against at most ``tile_k`` keys of one of the
sender's chunks, so scores never exceed ``[B, Hq, tile_q, tile_k]`` in fp32. The tiles
are planned once per row layout (every layer and the backward reuse the plan): a tile
whose mask is empty is skipped (the causal half, other documents), its keys narrowed to
the columns the tile can see, and a tile whose mask is full is computed without one.

Backward (flash attention's, per tile, with the final ``lse`` and ``delta = rowsum(dO * O)``):
``P = exp(S - lse)``, ``dV += P^T dO``, ``dS = P * (dO V^T - delta)``, ``dQ += dS K``,
``dK += dS^T Q``. K/V go around the ring again with their gradient accumulators, which
take one more hop at the end to reach their owner.

This is the PyTorch path on every device; a Triton ring kernel is not written yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # cp.py builds this backend (imported there lazily)
    from tandem.parallel.cp import SequenceSplit

TILE_Q = 256
TILE_K = 2048
_NEG = (
    -1e30
)  # the running max starts finite: exp(m_old - m_new) stays 1 while a row has seen nothing


@dataclass
class _Meta:
    """Per position of a rank's share: document and branch (or None) ``[B, n]``, column ``[n]``."""

    doc: torch.Tensor
    branch: torch.Tensor | None
    col: torch.Tensor

    def rows(self, a: int, b: int) -> _Meta:
        br = self.branch[:, a:b] if self.branch is not None else None
        return _Meta(self.doc[:, a:b], br, self.col[a:b])


def allowed(q: _Meta, k: _Meta) -> torch.Tensor:
    """``[B, nq, nk]``: True where query may read key (DocumentAttention's mask, by column)."""
    m = q.doc[:, :, None] == k.doc[:, None, :]
    if q.branch is not None:
        m &= (k.branch[:, None, :] == 0) | (q.branch[:, :, None] == k.branch[:, None, :])
    return m & (k.col[None, None, :] <= q.col[None, :, None])


@dataclass(frozen=True)
class _Tile:
    q0: int
    q1: int
    k0: int
    k1: int
    full: bool  # every pair allowed: no mask needed


class RingAttention:
    """The ring backend for one row layout (``group`` None: one rank, no ring, the same math).

    ``doc_ids`` / ``branch_ids [B, S]`` describe the unsplit row; ``guard.check(q)`` runs first
    at every call (tandem/parallel/cp.py)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        split: SequenceSplit,
        doc_ids: torch.Tensor,
        branch_ids: torch.Tensor | None = None,
        guard: Any = None,
        *,
        tile_q: int = TILE_Q,
        tile_k: int = TILE_K,
    ) -> None:
        self.group, self.split, self.guard = group, split, guard
        self.size, self.rank = split.size, split.rank
        dev = doc_ids.device
        self.metas = []
        for r in range(self.size):
            idx = split.index(r, device=dev)
            br = branch_ids.index_select(1, idx) if branch_ids is not None else None
            self.metas.append(_Meta(doc_ids.index_select(1, idx), br, idx))
        self.plan = [self._plan_step(s, tile_q, tile_k) for s in range(self.size)]
        if group is not None:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """Whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def _plan_step(self, step: int, tile_q: int, tile_k: int) -> list[_Tile]:
        qm, km = self.metas[self.rank], self.metas[self.source(step)]
        n, c = qm.col.numel(), km.col.numel() // len(self.split.chunks())
        tiles = []
        for q0 in range(0, n, tile_q):
            q1 = min(q0 + tile_q, n)
            qt = qm.rows(q0, q1)
            for c0 in range(
                0, km.col.numel(), c
            ):  # one key chunk at a time: its columns are contiguous
                ok = allowed(qt, km.rows(c0, c0 + c)).any(1).any(0)  # [C] columns the tile reads
                cols = ok.nonzero()[:, 0]
                if cols.numel() == 0:
                    continue
                lo, hi = c0 + int(cols[0]), c0 + int(cols[-1]) + 1
                for k0 in range(lo, hi, tile_k):
                    k1 = min(k0 + tile_k, hi)
                    tiles.append(_Tile(q0, q1, k0, k1, bool(allowed(qt, km.rows(k0, k1)).all())))
        return tiles

    def mask(self, step: int, t: _Tile) -> torch.Tensor:
        return allowed(
            self.metas[self.rank].rows(t.q0, t.q1), self.metas[self.source(step)].rows(t.k0, t.k1)
        )

    def exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[Any]:
        """Start sending ``sends`` to the next rank and receiving ``recvs`` from the previous."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs]
        return dist.batch_isend_irecv(ops)

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.guard is not None:
            self.guard.check(q)
        return _RingFn.apply(q, k, v, self)


def _heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, L, H, D]`` -> ``[B, Hkv, H/Hkv, L, D]`` (query heads grouped by their KV head)."""
    b, n, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, kv_heads, h // kv_heads, n, d)


def _unheads(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `_heads`."""
    b, hk, g, n, d = x.shape
    return x.reshape(b, hk * g, n, d).permute(0, 2, 1, 3)


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax and accumulator dtype: fp32 (fp64 for fp64 inputs, so gradcheck can check it)."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(
    ring: RingAttention, step: int, t: _Tile, qh: torch.Tensor, kh: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked scores ``[B, Hkv, g, tq, tk]`` (fp32) of one tile, -inf where not allowed."""
    s = (
        (qh[..., t.q0 : t.q1, :] @ kh[:, :, None, t.k0 : t.k1, :].transpose(-1, -2))
        .to(_acc(qh))
        .mul_(scale)
    )
    if not t.full:
        s.masked_fill_(~ring.mask(step, t)[:, None, None], float("-inf"))
    return s


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, L, Hq, D] in q's dtype, lse [B, Hkv, g, L] fp32)``."""
    hk, scale = k.shape[2], q.shape[-1] ** -0.5
    qh = _heads(q, hk)  # [B, Hkv, g, L, D]
    b, _, g, n, d = qh.shape
    m = torch.full((b, hk, g, n), _NEG, dtype=_acc(q), device=q.device)
    lsum = torch.zeros_like(m)
    acc = torch.zeros(b, hk, g, n, d, dtype=_acc(q), device=q.device)
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()  # [2, B, Hkv, Lk, D]
    for step in range(ring.size):
        reqs, nxt = [], None
        if step < ring.size - 1:
            nxt = torch.empty_like(kv)
            reqs = ring.exchange([kv], [nxt])
        for t in ring.plan[step]:
            s = _scores(ring, step, t, qh, kv[0], scale)
            m_old = m[..., t.q0 : t.q1]
            m_new = torch.maximum(m_old, s.amax(-1))
            p = s.sub_(m_new[..., None]).exp_()  # 0 where masked
            alpha = torch.exp(m_old - m_new)
            lsum[..., t.q0 : t.q1] = lsum[..., t.q0 : t.q1] * alpha + p.sum(-1)
            pv = (p.to(v.dtype) @ kv[1][:, :, None, t.k0 : t.k1, :]).to(acc.dtype)
            acc[..., t.q0 : t.q1, :] = acc[..., t.q0 : t.q1, :] * alpha[..., None] + pv
            m[..., t.q0 : t.q1] = m_new
        _wait(reqs)
        if nxt is not None:
            kv = nxt
    out = _unheads(acc.div_(lsum[..., None])).to(q.dtype)
    return out, m + torch.log(lsum)


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: RingAttention,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes."""
    hk, scale = k.shape[2], q.shape[-1] ** -0.5
    qh, doh = _heads(q, hk), _heads(dout, hk)  # [B, Hkv, g, L, D]
    a = _acc(q)
    delta = (doh.to(a) * _heads(out, hk).to(a)).sum(-1)  # [B, Hkv, g, L]
    dq = torch.zeros(qh.shape, dtype=a, device=q.device)
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()  # [2, B, Hkv, Lk, D]
    dkv = torch.zeros(kv.shape, dtype=a, device=q.device)  # travels with kv
    for step in range(ring.size):
        last = step == ring.size - 1
        reqs, nxt = [], None
        if not last:
            nxt = torch.empty_like(kv)
            reqs = ring.exchange([kv], [nxt])
        kh, vh = kv[0], kv[1]
        for t in ring.plan[step]:
            s = _scores(ring, step, t, qh, kh, scale)
            p = s.sub_(lse[..., t.q0 : t.q1, None]).exp_()  # [B, Hkv, g, tq, tk]
            do_t = doh[..., t.q0 : t.q1, :]
            dkv[1][..., t.k0 : t.k1, :] += (p.transpose(-1, -2).to(do_t.dtype) @ do_t).to(a).sum(2)
            dp = (do_t @ vh[:, :, None, t.k0 : t.k1, :].transpose(-1, -2)).to(a)
            ds = p.mul_(dp.sub_(delta[..., t.q0 : t.q1, None]))  # [B, Hkv, g, tq, tk]
            dq[..., t.q0 : t.q1, :] += (
                (ds.to(kh.dtype) @ kh[:, :, None, t.k0 : t.k1, :]).to(a).mul_(scale)
            )
            dk_t = ds.transpose(-1, -2).to(q.dtype) @ qh[..., t.q0 : t.q1, :]  # [B, Hkv, g, tk, D]
            dkv[0][..., t.k0 : t.k1, :] += dk_t.to(a).sum(2).mul_(scale)
        _wait(reqs)
        if ring.size > 1:  # the gradients go on with their K/V; after the last step, home
            got = torch.empty_like(dkv)
            _wait(ring.exchange([dkv], [got]))
            dkv = got
        if nxt is not None:
            kv = nxt
    dk, dv = (x.permute(0, 2, 1, 3).to(k.dtype) for x in dkv)  # [B, Lk, Hkv, D]
    return _unheads(dq).to(q.dtype), dk, dv


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):  # type: ignore[override]
        out, lse = ring_forward(q, k, v, ring)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring)
        return dq, dk, dv, None
