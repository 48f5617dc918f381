"""Token log-probs and entropy from logits that may be sharded on the vocab dim.

Under vocab-parallel TP (tandem/parallel/tp.py) the logits are a DTensor ``[B, S, V]``
placed ``Shard(-1)`` on the TP mesh: each rank holds ``[B, S, V/tp]``. Here the
log-softmax is assembled from per-rank pieces with three all-reduces over the TP
group of ``[B, S]`` tensors — the max (a detached shift, so no gradient), the
sum of exponentials, and the target logit (read on the rank whose vocab slice
holds the target, zero elsewhere) — so ``[B, S, V]`` is never gathered.

Gradients: every TP rank computes the same (replicated) loss, so the true
gradient of a summed piece w.r.t. a rank's local contribution is the incoming
gradient itself; the all-reduce therefore has an identity backward (Megatron's
"reduce from the model-parallel region").

Plain tensors (no TP, or TP with gathered logits) take the ordinary
``log_softmax`` + ``gather`` path. All results are fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "all_reduce_sum",
    "token_logprobs_at",
    "vocab_parallel_entropy",
    "vocab_parallel_token_logprobs",
]


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; identity backward (the consumer is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group`` for a consumer that every rank of it computes alike: the
    backward is the identity (each rank's gradient reaches its own contribution once)."""
    return _AllReduceSum.apply(x, group)


def _vocab_shard(
    logits: torch.Tensor,
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int, int]:
    """(local logits, TP group or None, vocab offset of the local slice, global vocab size)."""
    vocab = logits.shape[-1]
    if not isinstance(logits, DTensor):
        return logits, None, 0, vocab
    mesh = logits.device_mesh
    last = logits.ndim - 1
    shard_dims = [
        i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim in (-1, last)
    ]
    if not shard_dims:
        # Not vocab-sharded: materialise (a no-op for Replicate placements).
        return logits.full_tensor(), None, 0, vocab
    if len(shard_dims) > 1 or any(
        not p.is_replicate() for i, p in enumerate(logits.placements) if i not in shard_dims
    ):
        raise ValueError(f"logits must be Shard(-1) on one mesh dim, got {logits.placements}")
    mdim = shard_dims[0]
    n, r = mesh.size(mdim), mesh.get_local_rank(mdim)
    local = logits.to_local()  # [B, S, V_local]
    # DTensor shards follow torch.chunk: ceil(V/n) per rank, the tail may be short.
    chunk = -(-vocab // n)
    offset = min(r * chunk, vocab)
    if local.shape[-1] != max(0, min(chunk, vocab - offset)):
        raise ValueError(f"unexpected local vocab shard {tuple(local.shape)} for V={vocab}, n={n}")
    return local, mesh.get_group(mdim), offset, vocab


def _log_normaliser(
    local: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max [B,S], exp(local - max) [B,S,Vl], logsumexp [B,S]) over the full vocab, fp32."""
    z = local.float()  # [B, S, Vl]
    m = z.max(dim=-1).values.detach()  # [B, S]
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))  # [B, S, Vl]
    s = e.sum(dim=-1)  # [B, S]
    if group is not None:
        s = _AllReduceSum.apply(s, group)
    return m, e, m + torch.log(s)


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., targets]``: logits ``[B, S, V]`` (DTensor or plain),
    targets ``[B, S]`` int64 -> ``[B, S]`` fp32, differentiable w.r.t. the logits."""
    local, group, offset, _ = _vocab_shard(logits)
    if group is None:
        logp = torch.log_softmax(local.float(), dim=-1)  # [B, S, V]
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    _, _, lse = _log_normaliser(local, group)
    width = local.shape[-1]
    idx = targets - offset  # [B, S]
    here = (idx >= 0) & (idx < width)
    picked = local.float().gather(-1, idx.clamp(0, max(width - 1, 0)).unsqueeze(-1)).squeeze(-1)
    picked = _AllReduceSum.apply(torch.where(here, picked, torch.zeros_like(picked)), group)
    return picked - lse  # [B, S]


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[B, S, V]`` -> ``[B, S]`` fp32.

    ``H = logsumexp(z) - sum_v p_v z_v`` with ``sum_v p_v z_v = sum_v e_v z_v / sum_v e_v``.
    """
    local, group, _, _ = _vocab_shard(logits)
    if group is None:
        logp = torch.log_softmax(local.float(), dim=-1)  # [B, S, V]
        return -(logp.exp() * logp).sum(-1)
    m, e, lse = _log_normaliser(local, group)
    s = torch.exp(lse - m)  # [B, S] global sum of exp(z - m)
    ez = _AllReduceSum.apply((e * local.float()).sum(-1), group)  # [B, S]
    return lse - ez / s


def token_logprobs_at(
    logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``K`` positions of ``[B, S, V]`` logits, DTensor or plain.

    ``index``: ``[K]`` flat positions into ``B * S``; ``targets``: ``[K]`` ids. The
    positions are picked from the local (vocab-sharded) logits before any
    softmax work, so the normaliser runs over ``K`` rows, not ``B * S``.
    Returns ``[K]`` fp32 tensors, differentiable w.r.t. the logits.
    """
    local, group, offset, vocab = _vocab_shard(logits)
    picked = local.reshape(-1, local.shape[-1]).index_select(0, index)[None]  # [1, K, Vl]
    if group is None:
        logp_all = torch.log_softmax(picked.float(), dim=-1)
        logp = logp_all.gather(-1, targets[None, :, None])[0, :, 0]
        ent = -(logp_all.exp() * logp_all).sum(-1)[0] if with_entropy else None
        return logp, ent
    m, e, lse = _log_normaliser(picked, group)
    width = picked.shape[-1]
    idx = targets[None] - offset
    here = (idx >= 0) & (idx < width)
    z = picked.float().gather(-1, idx.clamp(0, max(width - 1, 0)).unsqueeze(-1)).squeeze(-1)
    logp = (_AllReduceSum.apply(torch.where(here, z, torch.zeros_like(z)), group) - lse)[0]
    ent = None
    if with_entropy:
        s = torch.exp(lse - m)
        ez = _AllReduceSum.apply((e * picked.float()).sum(-1), group)
        ent = (lse - ez / s)[0]
    return logp, ent
