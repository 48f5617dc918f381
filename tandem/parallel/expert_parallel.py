"""Expert parallelism: an MoE layer's experts sharded over ranks, tokens moved to them.

``apply_ep(model, mesh, ep)`` shards every `tandem.models.moe.GroupedExperts` over groups
of ``ep`` data-parallel shard ranks (``parallel.ep`` divides ``dp_shard``); FSDP2 leaves
these parameters alone and the tokens travel instead (all-to-alls per layer and
micro-batch). Expert gradients are rescaled and summed over replica groups so an update
equals the single-process one (tests/parallel/test_parallel_equivalence.py). Meshes,
the dispatch's steps and the gradient rule: docs/internals.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tandem.kernels.grouped_gemm import grouped_mm
from tandem.models.moe import GroupedExperts
from tandem.parallel.moe_tp import sum_gradients, sum_partials

__all__ = ["ExpertParallelExperts", "apply_ep", "ep_mesh", "expert_params", "validate_ep"]


def validate_ep(args: object, ep: int, dp_shard: int, tp: int, pp: int, dp_replicate: int) -> None:
    """ValueError (one line) unless this model can run with expert-parallel degree ``ep``."""
    if ep == 1:
        return
    experts = getattr(args, "num_experts", 0)
    if not experts:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model (this one is dense)")
    if dp_shard % ep:
        raise ValueError(
            f"ep={ep} must divide dp_shard={dp_shard} (expert parallelism borrows the FSDP2 ranks)"
        )
    if pp > 1:
        raise ValueError(f"ep={ep} runs without pipeline stages so far (pp={pp})")
    if tp > 1 and (ep != dp_shard or dp_replicate > 1):
        raise ValueError(
            f"ep={ep} with tp={tp} needs ep = dp_shard ({dp_shard}) and no HSDP "
            f"(dp_replicate={dp_replicate}) so far"
        )
    if experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={experts}")


def _scale_grad(
    t: torch.Tensor, scale: float, replicas: dist.ProcessGroup | None = None
) -> torch.Tensor:
    return _ScaleGrad.apply(t, scale, replicas)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``, summed over ``replicas`` when given
    (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        t: torch.Tensor,
        scale: float,  # noqa: ANN001
        replicas: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.scale, ctx.replicas = scale, replicas
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        g = g * ctx.scale
        if ctx.replicas is not None:
            dist.all_reduce(g, group=ctx.replicas)
        return g, None, None


class ExpertParallelExperts(GroupedExperts):
    """A `GroupedExperts` whose weights are this rank's shard; forward moves the tokens.

    Made by `apply_ep` in place (the class is swapped, parameter names stay)."""

    group: dist.ProcessGroup  # the ep ranks that hold one copy of every expert
    ep: int
    replicas: dist.ProcessGroup | None  # the ranks holding the same experts (None: ep == dp)
    dp: int  # data-parallel ranks (FSDP2 averages the other gradients over them)
    tp_group: dist.ProcessGroup | None  # with TP: experts also split by hidden features over it

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self._dispatch(x_sorted, offsets)
        # TP (tandem/parallel/moe_tp.py): every TP rank sends the same rows to its EP peers of the
        # same TP coordinate, which hold I / tp of each expert's hidden features: partial outputs
        return sum_partials(
            self._dispatch(sum_gradients(x_sorted, self.tp_group), offsets), self.tp_group
        )

    def _dispatch(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep, self.group
        w1, w2, w3 = (
            _scale_grad(
                w.to_local() if isinstance(w, DTensor) else w, 1.0 / self.dp, self.replicas
            ).to(x_sorted.dtype)
            for w in (self.w1, self.w2, self.w3)
        )
        local = w1.shape[0]
        # [E] rows per expert
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # [ep (source), local]
        send = counts.view(ep, local).sum(1).tolist()
        recv_by_src = recv_counts.view(ep, local)
        recv = recv_by_src.sum(1).tolist()
        x_recv = all_to_all_single(
            x_sorted.new_empty(sum(recv), x_sorted.shape[1]), x_sorted, recv, send, group=group
        )  # rows by source rank, then by local expert
        order = _by_expert(recv_by_src)  # received row -> its place grouped by local expert
        local_offsets = recv_by_src.sum(0).cumsum(0).to(torch.int32)  # [local]
        x_local = x_recv[order]
        gate = grouped_mm(x_local, w1.transpose(1, 2), local_offsets)
        up = grouped_mm(x_local, w3.transpose(1, 2), local_offsets)
        y_local = grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), local_offsets)
        y_recv = (
            torch.empty_like(y_local).index_copy(0, order, y_local) if y_local.numel() else y_local
        )
        return all_to_all_single(
            x_sorted.new_empty(x_sorted.shape[0], y_recv.shape[1]), y_recv, send, recv, group=group
        )


def _by_expert(recv_by_src: torch.Tensor) -> torch.Tensor:
    """Indices into the received rows (grouped by source, then local expert) that list them
    grouped by local expert, then source: the layout the grouped GEMM takes."""
    ep, local = recv_by_src.shape
    starts = torch.cat([recv_by_src.new_zeros(1), recv_by_src.reshape(-1).cumsum(0)[:-1]]).view(
        ep, local
    )
    pieces = [
        torch.arange(
            int(starts[s, e]), int(starts[s, e] + recv_by_src[s, e]), device=recv_by_src.device
        )
        for e in range(local)
        for s in range(ep)
    ]
    return torch.cat(pieces) if pieces else recv_by_src.new_zeros(0)


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights `apply_ep` sharded (FSDP2 must ignore them)."""
    return {
        p for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()
    }


def ep_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The mesh experts are sharded over: ``mesh`` (1-D, the FSDP2 shard ranks) itself when
    ``ep`` is its size, else ``("ep_replicate", "ep")`` of shape ``(size / ep, ep)``, each
    ``ep`` consecutive ranks one group (a 2-D HSDP mesh is flattened first, replicate-major).
    Collective the first time (new process groups); cached on the root mesh after that, so
    the policy, reference and teachers share the groups (slicing a root mesh makes a new
    submesh object each time)."""
    if mesh.ndim == 1 and ep == mesh.size():
        return mesh
    cache = mesh._get_root_mesh().__dict__.setdefault("_tandem_ep_meshes", {})
    key = (mesh.mesh_dim_names, ep)
    if key not in cache:
        flat = mesh if mesh.ndim == 1 else mesh._flatten("dp_for_ep")
        cache[key] = flat._unflatten(0, (flat.size() // ep, ep), ("ep_replicate", "ep"))
    return cache[key]


def apply_ep(
    model: nn.Module,
    mesh: DeviceMesh,
    ep: int | None = None,
    *,
    ep_tp_mesh: DeviceMesh | None = None,
) -> int:
    """Shard every `GroupedExperts` of ``model`` over ``ep`` of the ranks of ``mesh`` (the
    data-parallel mesh: 1-D FSDP2 shard ranks, or 2-D HSDP ``(dp_replicate, dp_shard)``; ``ep``
    divides the shard ranks and defaults to all of them), in place, on the meta device or
    materialised; returns how many. ``ep_tp_mesh``, the 2-D ``(dp_shard, tp)`` mesh under
    tensor parallelism (``ep`` = dp_shard, no HSDP): each expert is also split by its hidden
    features over ``tp`` (``w1``/``w3`` ``[Shard(0), Shard(1)]``, ``w2`` ``[Shard(0),
    Shard(2)]``)."""
    dp_shard, dp = mesh.size(mesh.ndim - 1), mesh.size()
    ep = dp_shard if ep is None else ep
    if dp_shard % ep:
        raise ValueError(f"ep={ep} must divide the {dp_shard} FSDP2 shard ranks")
    tp_group = None
    if ep_tp_mesh is not None:
        if ep != dp or ep_tp_mesh.size(0) != ep:
            raise ValueError(f"ep={ep} with tensor parallelism needs ep = dp_shard and no HSDP")
        emesh, group, replicas, tp_group = (
            ep_tp_mesh,
            ep_tp_mesh.get_group(0),
            None,
            ep_tp_mesh.get_group(1),
        )
        placements = {
            "w1": [Shard(0), Shard(1)],
            "w3": [Shard(0), Shard(1)],
            "w2": [Shard(0), Shard(2)],
        }
    else:
        emesh = ep_mesh(mesh, ep)
        one = [Shard(0)] if emesh is mesh else [Replicate(), Shard(0)]
        placements = dict.fromkeys(("w1", "w2", "w3"), one)
        group = mesh.get_group() if emesh is mesh else emesh.get_group("ep")
        replicas = None if emesh is mesh else emesh.get_group("ep_replicate")
    n = 0
    for m in model.modules():
        if type(m) is GroupedExperts:
            for name in ("w1", "w2", "w3"):
                p = getattr(m, name)
                setattr(
                    m,
                    name,
                    nn.Parameter(
                        distribute_tensor(p.data, emesh, placements[name]),
                        requires_grad=p.requires_grad,
                    ),
                )
            m.__class__ = ExpertParallelExperts
            m.group, m.ep, m.replicas, m.dp, m.tp_group = group, ep, replicas, dp, tp_group
            n += 1
    return n
