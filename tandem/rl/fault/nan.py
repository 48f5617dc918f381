"""NaN/Inf guard between backward and optimizer.step, agreed across ranks.

One non-finite gradient poisons the weights on the next optimizer step, and
with FSDP2 the NaN may sit in a shard that only one rank holds. `check_finite`
checks the loss and every local gradient shard (``DTensor.to_local()``),
all-reduces one flag so every rank takes the same branch, and only on the
failure path does the extra work of naming the first offending tensor (a
gather of each rank's finding, so every rank's message names it):

    policy "skip": returns False -> the trainer zeroes the gradients, skips
                   optimizer.step, and counts the skip in its metrics;
    policy "stop": writes <dump>/nan/rank-<r>.json and raises NonFiniteError
                   (one line: step, rank, tensor) -> exit status EXIT_NONFINITE.

Cost on the healthy path: one multi-tensor norm of the gradients, one
all-reduce of one int and one host sync per step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tandem import device as seam
from tandem.rl.core.errors import NonFiniteError
from tandem.rl.core.health import waiting

Policy = Literal["skip", "stop"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _clean(name: str) -> str:
    # lazy: keeps this module importable without the model stack
    from tandem.parallel.ac import clean_fqn

    return clean_fqn(name)


def _named_grads(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    parts: Iterable[nn.Module] = [model] if isinstance(model, nn.Module) else model
    out = []
    for part in parts:  # pipeline stages hold several model parts
        for name, p in part.named_parameters():
            if p.grad is not None:
                out.append((_clean(name), _local(p.grad)))
    return out


def _kind(t: torch.Tensor) -> str:
    return "nan" if bool(torch.isnan(t).any()) else "inf"


def _finite_flags(tensors: list[torch.Tensor], exact: bool) -> torch.Tensor:
    """bool [len(tensors)]: is every element finite.

    ``exact=False`` (the healthy path): one multi-tensor norm call (a NaN or Inf element
    makes its tensor's norm non-finite; so can finite values that overflow the norm, which
    the exact check then clears) instead of an ``isfinite().all()`` per tensor.
    """
    if not tensors:
        return torch.ones(0, dtype=torch.bool)
    device = tensors[0].device
    if exact:
        return torch.stack([torch.isfinite(t).all().to(device) for t in tensors])
    return torch.stack([n.to(device) for n in torch._foreach_norm(tensors)]).isfinite()


def _any_bad(flags: torch.Tensor, group: dist.ProcessGroup | None, distributed: bool) -> bool:
    """Whether any rank of ``group`` has a False flag (one all-reduce, one host sync)."""
    any_bad = (
        (~flags).any().to(torch.int32).reshape(1)
        if flags.numel()
        else torch.zeros(1, dtype=torch.int32)
    )
    if distributed:
        any_bad = any_bad.to(seam.collective_device(group))
        with waiting("all_reduce:nonfinite_flag"):  # the first collective after the backward
            dist.all_reduce(any_bad, op=dist.ReduceOp.MAX, group=group)
            return bool(any_bad.item())  # deliberate host sync: every rank branches on it
    return bool(any_bad.item())


def _local_finding(
    loss: torch.Tensor | None, grads: list[tuple[str, torch.Tensor]], flags: torch.Tensor, rank: int
) -> dict[str, Any] | None:
    """The first non-finite tensor on this rank (loss first, then gradients in parameter order)."""
    bad = (~flags).cpu().tolist()  # failure path only: one transfer
    if not any(bad):
        return None
    n_grads_bad = sum(bad[1:]) if loss is not None else sum(bad)
    if loss is not None and bad[0]:
        where, name, kind = "loss", "loss", _kind(_local(loss).detach())
    else:
        i = bad.index(True) - (1 if loss is not None else 0)
        name, g = grads[i]
        where, kind = "grad", _kind(g)
    return {
        "rank": rank,
        "where": where,
        "tensor": name,
        "kind": kind,
        "nonfinite_grads": n_grads_bad,
    }


class Rollback(Exception):
    """``fault.on_nonfinite = "rollback"``: step ``step`` (from 1) had a non-finite loss or
    gradient on some rank, or (``fault.spike_zscore``) a gradient-norm spike; every rank
    raises it at the same point, and the training shell reloads the newest checkpoint and
    skips that step's prompts (tandem/rl/recipes/loop.py)."""

    def __init__(self, step: int, why: str = "non-finite loss or gradient") -> None:
        super().__init__(f"step {step}: {why}")
        self.step = step


def check_finite(
    loss: torch.Tensor | None,
    model: nn.Module | Sequence[nn.Module],
    step: int,
    rank: int,
    policy: Policy = "stop",
    *,
    dump_folder: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """True if the loss and all gradients are finite on every rank of ``group``.

    Collective when ``group`` has more than one rank: call it on every rank at
    the same point (after backward, before clipping and optimizer.step). On a
    non-finite value anywhere: policy "skip" returns False on every rank;
    policy "stop" writes the report (when ``dump_folder`` is given) and
    raises `NonFiniteError` on every rank.
    """
    if policy not in ("skip", "stop", "rollback"):
        raise ValueError(
            f"check_finite: policy must be 'skip', 'stop' or 'rollback', got {policy!r}"
        )
    grads = _named_grads(model)
    tensors = ([_local(loss).detach().reshape(1)] if loss is not None else []) + [
        g for _, g in grads
    ]
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if not _any_bad(_finite_flags(tensors, exact=False), group, distributed):
        return True
    flags = _finite_flags(tensors, exact=True)  # failure path: element by element, agreed again
    if not _any_bad(flags, group, distributed):  # a norm overflowed, every element is finite
        return True

    mine = _local_finding(loss, grads, flags, rank)  # reached only with a non-finite tensor
    findings: list[dict[str, Any] | None] = [mine]
    if distributed:
        findings = [None] * dist.get_world_size(group)
        dist.all_gather_object(findings, mine, group=group)
    first = next((f for f in findings if f is not None), None)
    where = (
        (
            f"{first['kind']} in the "
            f"{'loss' if first['where'] == 'loss' else 'gradient of ' + first['tensor']} on rank "
            f"{first['rank']}"
        )
        if first
        else "non-finite value in an unknown tensor"
    )
    if policy in ("skip", "rollback"):
        if first is not None and first["rank"] == rank:
            then = "step skipped" if policy == "skip" else "rolling back"
            print(f"[rank {rank}] step {step}: {where}: {then}", flush=True)
        return False

    report = {
        "step": step,
        "rank": rank,
        "time": time.time(),
        "policy": policy,
        "local": mine,
        "first": first,
        "tensor": first["tensor"] if first else None,
        "kind": first["kind"] if first else None,
        "where": first["where"] if first else None,
        "offending_ranks": [f["rank"] for f in findings if f is not None],
    }
    if dump_folder is not None:
        folder = os.path.join(dump_folder, "nan")
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".rank-{rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, os.path.join(folder, f"rank-{rank}.json"))
    seen = "" if first is not None and first["rank"] == rank else f" (seen from rank {rank})"
    raise NonFiniteError(f"step {step}: {where}{seen}", report)
