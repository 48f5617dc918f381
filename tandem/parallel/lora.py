"""Tensor parallelism for LoRA-adapted projections (tandem/models/lora.py), applied from outside.

A `LoraLinear` is planned like the plain linear it adapts (tandem/parallel/tp.py), with its
adapters placed so the low-rank path needs no collective of its own:

- column-parallel (q, k, v, gate, up): ``A [r, in]`` replicated, ``B [out, r]`` split by
  output rows like the base, so a rank computes its own output features of ``(x A^T) B^T``;
- row-parallel (o, down): ``A [r, in]`` split by input features like the base and ``B``
  replicated: ``(x_local A_local^T) B^T`` is a partial sum, added to the base's partial sum
  before the one reduce(-scatter) the base already does.

`distribute_module` calls a style's partition function on the module and then on each of its
submodules; the adapted module places its adapters itself and the calls on them do nothing.
The module's forward runs on DTensors (the styles' input hooks make the input one), so
DTensor autograd gives the replicated factors their partial gradients, which tp.py's
end-of-backward hook (or FSDP2) reduces like any replicated norm weight's. The generation
layout splits adapters the same way (tandem/parallel/generation_layout.py). Adapters on
grouped experts are not split here: `check_lora_layout` refuses them under TP and EP.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tandem.models.lora import LoraGroupedExperts, LoraLinear


def _place(
    owner: nn.Module, name: str, mesh: Any, placement: Any, src_data_rank: int | None
) -> None:
    p = getattr(owner, name)
    owner.register_parameter(
        name,
        nn.Parameter(
            distribute_tensor(p, mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=p.requires_grad,
        ),
    )


class LoraColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a `LoraLinear`: base and ``B`` split by output rows, ``A``
    replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        if not isinstance(module, LoraLinear):
            # called for every submodule: the adapters are placed below
            return
        for owner, pname, placement in (
            (module, "weight", Shard(0)),
            (module, "bias", Shard(0)),
            (module.lora_A, "weight", Replicate()),
            (module.lora_B, "weight", Shard(0)),
        ):
            if getattr(owner, pname) is not None:
                _place(owner, pname, device_mesh, placement, self.src_data_rank)


class LoraRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` for a `LoraLinear`: base and ``A`` split by input features, ``B``
    replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        if not isinstance(module, LoraLinear):
            # called for every submodule: the adapters are placed below
            return
        for owner, pname, placement in (
            (module, "weight", Shard(1)),
            (module, "bias", Replicate()),
            (module.lora_A, "weight", Shard(1)),
            (module.lora_B, "weight", Replicate()),
        ):
            if getattr(owner, pname) is not None:
                _place(owner, pname, device_mesh, placement, self.src_data_rank)


def lora_plan(block: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (a block's parallelize_module plan) with the styles of adapted linears swapped for
    their LoRA versions (same input / output layouts); a plan without adapters comes back as is."""
    out = dict(plan)
    for path, style in plan.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(module, LoraLinear) or type(style) not in (
            ColwiseParallel,
            RowwiseParallel,
        ):
            continue
        new = copy.copy(style)
        new.__class__ = (
            LoraColwiseParallel if isinstance(style, ColwiseParallel) else LoraRowwiseParallel
        )
        out[path] = new
    return out


def check_lora_layout(model: nn.Module, *, tp: int, ep: int) -> None:
    """ValueError (one line) when adapters sit where the layout cannot split them yet."""
    if (tp > 1 or ep > 1) and any(isinstance(m, LoraGroupedExperts) for m in model.modules()):
        raise ValueError(
            f"LoRA on routed experts runs with tp = ep = 1 so far (tp={tp}, ep={ep}); "
            "adapt attention / shared-expert projections instead"
        )
