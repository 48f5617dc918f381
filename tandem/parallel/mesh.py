"""The device mesh: one named axis per kind of parallelism.

Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (HSDP
replicas), ``dp_shard`` (FSDP2 shards), ``cp`` (context parallel: the ranks that
split one sequence, tandem/parallel/cp.py), ``tp`` (tensor parallel, innermost so a
TP group sits on one node). Every axis exists even at size 1, so callers never
branch on whether an axis is present.

The ``cp`` ranks of a data-parallel rank hold the same samples and the same
parameters, so FSDP2 shards over ``dp_shard x cp`` (`dp_mesh`, flattened to
``dp_shard_cp``): a cp rank's gradient covers its share of the tokens only and the
reduce-scatter sums the shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks (each sees different data)."""
        return self.dp_replicate * self.dp_shard


def build_mesh(degrees: Degrees, device: torch.device) -> DeviceMesh:
    shape = tuple(getattr(degrees, a) for a in AXES)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=AXES)
    if degrees.cp > 1:
        dp_mesh(mesh)  # collective the first time (new groups): made here, on every rank in step
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP2 shards over (2-D for HSDP): the data-parallel ranks and, under
    context parallelism, their cp ranks (``dp_shard x cp`` flattened to ``dp_shard_cp``; under
    HSDP ``(dp_replicate, dp_shard_cp)``), cached on the root mesh after the first call."""
    if mesh["cp"].size() == 1:
        if mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]
    cache = mesh._get_root_mesh().__dict__.setdefault("_tandem_fsdp_mesh", {})
    if "mesh" not in cache:
        replicas = mesh["dp_replicate"].size()
        if replicas == 1:
            cache["mesh"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        else:  # flatten all three, replicate-major, then cut into (replicas, the rest)
            flat = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_replicate_shard_cp")
            names = ("dp_replicate", "dp_shard_cp")
            cache["mesh"] = flat._unflatten(0, (replicas, flat.size() // replicas), names)
    return cache["mesh"]


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (replicate-major)."""
    return (
        mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size()
        + mesh["dp_shard"].get_local_rank()
    )


def mesh_coords(degrees: Degrees, index: int) -> dict[str, int]:
    """The coordinate on every axis of the ``index``-th rank of a mesh of ``degrees`` (row-major
    over `AXES`, as `build_mesh` lays it out), without the mesh: what ranks outside it use."""
    coord = {}
    for axis in reversed(AXES):
        coord[axis], index = index % getattr(degrees, axis), index // getattr(degrees, axis)
    return coord


def dp_ranks(degrees: Degrees) -> list[int]:
    """`dp_rank` of each rank of a mesh of ``degrees``, by its index in the mesh."""
    coords = [mesh_coords(degrees, i) for i in range(degrees.world_size)]
    return [c["dp_replicate"] * degrees.dp_shard + c["dp_shard"] for c in coords]


def mesh_lines(mesh: DeviceMesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Global ranks of every group of ``mesh`` spanned by ``axes`` (one list per coordinate of
    the other axes; within a list, ranks in ``axes`` order). ``mesh`` is a root mesh."""
    names = list(mesh.mesh_dim_names or ())
    n = 1
    for a in axes:
        n *= mesh.mesh.shape[names.index(a)]
    order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
    return mesh.mesh.permute(*order).reshape(-1, n).tolist()


def new_groups(lines: list[list[int]], alone: bool = False) -> dist.ProcessGroup | None:
    """Collective: ``new_group`` for every list, in order (every rank calls); this rank's group,
    or None when this rank is in none of them or its group is itself alone (``alone``: a group
    of one all the same, for a caller to whom None would mean the whole world)."""
    me, mine = dist.get_rank(), None
    for ranks in lines:
        group = dist.new_group(ranks)
        if me in ranks and (len(ranks) > 1 or alone):
            mine = group
    return mine


def subgroup(mesh: DeviceMesh, axes: tuple[str, ...]) -> dist.ProcessGroup | None:
    """This rank's process group over the mesh ``axes`` (the ranks that differ only along them).

    Collective: every rank calls it, in the same order, once (at setup; it
    creates one group per coordinate of the other axes). None when the group
    would be this rank alone.
    """
    lines = mesh_lines(mesh, axes)
    return new_groups(lines) if len(lines[0]) > 1 else None
