"""Silent divergence between data-parallel replicas: an exact checksum compared across them.

With HSDP (``parallel.dp_replicate`` > 1) every shard of every parameter is held by
``dp_replicate`` ranks that must hold it bit for bit: they start equal and apply the same
all-reduced gradients. A flipped bit (a faulty HBM cell, an SDC in a GPU) makes one copy drift
without any NaN, and the replicas then train different models while every loss looks fine.
`check_replicas` hashes each rank's local shard of every parameter with the exact, order-free
checksum split mode uses for its weight sync (tandem/parallel/checksum.py: any single bit
changes it), gathers the sums inside each replica group (``dp_replicate`` sub-mesh of the
parameters' mesh), and agrees on the outcome with one all-reduce over the world. A mismatch
names the step, the first differing tensor and the rank that differs from the others of its
group (with two replicas the two cannot be told apart: both are named), writes
``<dump>/replica/rank-<r>.json`` and raises `ReplicaMismatch` (exit status EXIT_REPLICA).

Cost: one pass over the local parameters (int64 arithmetic, one host sync per tensor), one
small gather per replica group and one all-reduce, every ``fault.replica_check_steps`` steps.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tandem import device as seam
from tandem.parallel.checksum import box_checksum
from tandem.rl.core.errors import ReplicaMismatch
from tandem.rl.core.health import waiting
from tandem.rl.fault.inject import flip_bit

AXIS = "dp_replicate"


def _replicated(modules: Sequence[nn.Module]) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """The replica group and (name, local shard) of every parameter held by more than one
    replica (None, [] without HSDP)."""
    group, out = None, []
    for module in modules:
        for name, p in module.named_parameters():
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or ()
            if AXIS not in names or mesh.size(names.index(AXIS)) == 1:
                continue
            group = mesh.get_group(AXIS)
            out.append((name, p.to_local().detach()))
    return group, out


def local_sums(params: list[tuple[str, torch.Tensor]]) -> list[int]:
    """The exact checksum of each local shard (the same shard on every replica)."""
    return [box_checksum(n, t, (0,) * t.dim(), tuple(t.shape)) for n, t in params]


def compare(names: list[str], sums: dict[int, list[int]]) -> dict[str, Any] | None:
    """``sums``: each replica's (global rank -> per-tensor checksums). The first tensor whose
    checksums differ, the rank(s) that differ from the most common value (every rank when no
    value is held by more of them than another), or None when all agree."""
    ranks = sorted(sums)
    for i, name in enumerate(names):
        values = {r: sums[r][i] for r in ranks}
        if len(set(values.values())) == 1:
            continue
        counts = Counter(values.values()).most_common()
        top = counts[0][0] if counts[0][1] > counts[1][1] else None
        odd = [r for r in ranks if top is None or values[r] != top]
        return {"tensor": name, "ranks": odd, "replicas": ranks, "checksums": values}
    return None


def check_replicas(modules: Sequence[nn.Module], step: int, rank: int, dump_folder: str) -> None:
    """Collective over the world: raise `ReplicaMismatch` on every rank when any replica group
    holds a parameter shard that differs between its replicas."""
    group, params = _replicated(modules)
    finding = None
    if group is not None:
        flip_bit(step, rank, params)  # fault drill (TANDEM_INJECT_FLIP)
        mine = local_sums(params)
        every: list[Any] = [None] * dist.get_world_size(group)
        with waiting("all_gather:replica_checksums"):
            dist.all_gather_object(every, (rank, socket.gethostname(), mine), group=group)
        finding = compare([n for n, _ in params], {r: sums for r, _, sums in every})
        if finding:
            hosts = {r: h for r, h, _ in every}
            finding["hosts"] = [hosts[r] for r in finding["ranks"]]
    bad = torch.tensor([1 if finding else 0], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        bad = bad.to(seam.collective_device())
        with waiting("all_reduce:replica_flag"):
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not int(bad.item()):
        return
    found: list[Any] = [finding]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, finding)
    first = next(f for f in found if f)
    odd, rest = first["ranks"], [r for r in first["replicas"] if r not in first["ranks"]]
    on = ", ".join(first["hosts"])
    who = (
        f"rank {odd[0]} (host {on}) differs from its replicas {rest}"
        if len(odd) == 1
        else f"replicas {odd} (hosts {on}) differ (with two, which one is wrong cannot be told)"
    )
    msg = f"step {step}: {who} in {first['tensor']} (checksums {first['checksums']})"
    report = {"step": step, "rank": rank, "time": time.time(), "first": first, "message": msg}
    folder = os.path.join(dump_folder, "replica")
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".rank-{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, os.path.join(folder, f"rank-{rank}.json"))
    raise ReplicaMismatch(msg)
