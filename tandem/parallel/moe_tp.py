"""Tensor parallelism for a mixture-of-experts block (tandem/models/moe.py), applied from outside.

Under TP every rank of the group routes *all* the block's tokens (the input is
all-gathered over the sequence, as for the dense MLP), so routing, the router
losses and the routing records are those of one process. The pieces:

- the router ``gate`` (and a shared expert's ``shared_expert_gate``) stays whole
  on every TP rank (a ``Replicate`` DTensor, `WholeOnEveryRank`, so the optimizer
  sees one kind of tensor): its input and output are the same on every rank, so
  its gradient is too, and nothing is reduced over TP;
- each expert is split by its hidden features like the dense MLP: ``w1``/``w3``
  ``[E, I, D]`` by ``I`` (``Shard(1)``), ``w2`` ``[E, D, I]`` by ``I``
  (``Shard(2)``); `TensorParallelExperts` runs the grouped GEMMs on the local
  columns and sums the partial outputs over the group (forward all-reduce,
  backward identity), and sums the input's partial gradients (forward identity,
  backward all-reduce);
- a shared expert is column / row parallel like the dense MLP, its output
  all-reduced;
- the block's output, whole on every rank, is cut back to this rank's sequence
  shard under sequence parallel (no communication; its gradient is gathered).

With expert parallelism too (``parallel.ep`` = dp_shard, tandem/parallel/expert_parallel.py)
each expert is split both ways, and the same two sums wrap the token dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from tandem.kernels.grouped_gemm import grouped_mm
from tandem.models.moe import GroupedExperts

__all__ = [
    "TensorParallelExperts",
    "WholeOnEveryRank",
    "moe_block_plan",
    "shard_experts_tp",
    "sum_gradients",
    "sum_partials",
]


class WholeOnEveryRank(ParallelStyle):
    """A module computed whole on every TP rank from the same local input: its parameters become
    ``Replicate`` DTensors, its input is wrapped and its output unwrapped (no communication)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                else t
                for t in inputs
            )

        def unwrap(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, None, wrap, unwrap)


class _SumPartials(torch.autograd.Function):
    """Forward: all-reduce the group's partial sums; backward: the (whole) gradient as is."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return g, None


class _SumGradients(torch.autograd.Function):
    """Forward: the (whole) input as is; backward: all-reduce the group's partial gradients."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def sum_partials(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of its ranks' partial ``t`` (the gradient passes through whole)."""
    return _SumPartials.apply(t, group)


def sum_gradients(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` itself; its gradient is the sum over ``group`` of the ranks' partial gradients."""
    return _SumGradients.apply(t, group)


class TensorParallelExperts(GroupedExperts):
    """A `GroupedExperts` holding ``I / tp`` hidden features of every expert; forward sums the
    group's partial outputs. Made by `shard_experts_tp` in place (parameter names stay)."""

    group: dist.ProcessGroup

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)
        )
        x = sum_gradients(x_sorted, self.group)
        gate = grouped_mm(x, w1.transpose(1, 2), offsets)  # [R, I/tp]
        up = grouped_mm(x, w3.transpose(1, 2), offsets)
        # [R, D], this rank's share
        partial = grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offsets)
        return sum_partials(partial, self.group)


def shard_experts_tp(experts: GroupedExperts, tp_mesh: DeviceMesh) -> None:
    """Split ``experts`` by hidden features over ``tp_mesh`` in place (meta or materialised)."""
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        p = getattr(experts, name)
        setattr(
            experts,
            name,
            nn.Parameter(
                distribute_tensor(p.data, tp_mesh, [Shard(dim)]), requires_grad=p.requires_grad
            ),
        )
    experts.__class__ = TensorParallelExperts
    experts.group = tp_mesh.get_group()


def moe_block_plan(block: nn.Module, stream: Placement) -> dict[str, Any]:
    """The parallelize_module plan entries of a block whose feed-forward is ``block.moe``
    (``stream``: the residual stream's placement, ``Shard(1)`` under sequence parallel).
    The experts themselves are split by `shard_experts_tp` (no ParallelStyle fits them)."""
    plan: dict[str, Any] = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(stream,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(stream,),
            use_local_output=True,
        ),
    }
    plan["moe.gate"] = WholeOnEveryRank()
    if block.moe.shared_expert_gate is not None:
        plan["moe.shared_expert_gate"] = WholeOnEveryRank()
    if block.moe.shared_experts is not None:
        plan["moe.shared_experts.w1"] = ColwiseParallel()
        plan["moe.shared_experts.w3"] = ColwiseParallel()
        plan["moe.shared_experts.w2"] = RowwiseParallel()
    return plan
