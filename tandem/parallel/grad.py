"""Gradient-norm clipping over sharded (DTensor) and plain parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    group: dist.ProcessGroup | None = None,
    duplicates: Iterable[torch.nn.Parameter] = (),
) -> float:
    """Clip to ``max_norm`` (0 = only measure); returns the total norm before clipping.

    DTensor gradients are reduced over their own mesh (FSDP / TP shards, EP groups).
    ``group``: the ranks holding *different* parameters that make up the model
    (the pipeline stages); their squared norms are summed over it.
    ``duplicates``: parameters that repeat one counted elsewhere (a pipeline's
    tied output copy): scaled with the rest, left out of the norm.
    One host sync (the returned float), on purpose: the norm is logged every step.
    """
    dup = {id(p) for p in duplicates}
    params = list(params)
    counted = [p.grad for p in params if p.grad is not None and id(p) not in dup]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and group is None:
        return 0.0
    parts = []  # one norm per mesh: experts in EP groups live on a mesh of their own
    for same_mesh in _by_mesh(counted):
        part = torch.nn.utils.get_total_norm(same_mesh, norm_type=2.0, foreach=True)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if not parts:
        norm = torch.zeros((), device=grads[0].device if grads else "cpu")
    else:
        norm = (
            parts[0]
            if len(parts) == 1
            else torch.stack([p.float() ** 2 for p in parts]).sum().sqrt()
        )
    if group is not None:
        sq = (norm.float() ** 2).reshape(1)
        dist.all_reduce(sq, group=group)
        norm = sq[0].sqrt()
    total = float(norm)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(coef)
    return total


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients grouped by DTensor mesh (plain tensors together), in first-seen order:
    one norm reduction can only span one mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return list(groups.values())
