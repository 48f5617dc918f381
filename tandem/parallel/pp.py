"""Pipeline parallelism: split a Transformer by layers into stages and schedule them.

`pipeline_split` assigns contiguous layer ranges to stages; `build_pipeline` makes this
rank's stage modules (the whole model less the other layers) and wraps them in torch's
"1F1B", "GPipe" or "Interleaved1F1B" schedule. `Pipeline.step` packs the RL loss's
per-token tensors into one tensor so the schedule can split them into micro-batches;
gradients are summed over micro-batches; tied embeddings are kept as two copies whose
gradients are summed (`Pipeline.sync_tied_grads`); `Pipeline.forward_only` scores without
autograd. The details: docs/internals.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from tandem.parallel.mesh import mesh_lines, new_groups

__all__ = ["SCHEDULES", "Pipeline", "build_pipeline", "pipeline_split", "stage_ids_for_rank"]

# schedule name -> (torch class, stages per rank)
SCHEDULES: dict[str, tuple[type, int]] = {
    "1F1B": (Schedule1F1B, 1),
    "GPipe": (ScheduleGPipe, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
}

LossFn = Callable[..., torch.Tensor]
# activations sent between stages
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _stages_per_rank(schedule_name: str) -> int:
    if schedule_name not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule_name!r}; choose from {sorted(SCHEDULES)}"
        )
    return SCHEDULES[schedule_name][1]


def pipeline_split(
    model_args: Any, pp: int, num_layers: int | None = None, *, stages_per_rank: int = 1
) -> list[list[int]]:
    """Layer ids of each of the ``pp * stages_per_rank`` stages, contiguous and in order.

    ``num_layers`` defaults to ``model_args.num_layers``. Raises ValueError (one
    line) when a stage would get no layer.
    """
    n_layers = model_args.num_layers if num_layers is None else num_layers
    n_stages = pp * stages_per_rank
    if pp < 1:
        raise ValueError(f"pipeline parallel degree must be >= 1, got pp={pp}")
    if n_stages > n_layers:
        what = f"pp={pp}" if stages_per_rank == 1 else f"pp={pp} x {stages_per_rank} virtual stages"
        raise ValueError(
            f"pipeline parallel {what} needs at least {n_stages} layers, model has "
            f"num_layers={n_layers}"
        )
    base, rem = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < rem else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages held by ``pp_rank`` (looped placement: r, r + pp, ...)."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def _make_stage_module(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    layer_ids: list[int],
    is_first: bool,
    is_last: bool,
) -> nn.Module:
    """A copy of the (meta) model keeping only ``layer_ids`` and the ends it owns."""
    if isinstance(model_or_factory, nn.Module):
        module = copy.deepcopy(model_or_factory)  # cheap on meta
    else:
        module = model_or_factory()
    keep = {str(i) for i in layer_ids}
    for name in list(module.layers.keys()):
        if name not in keep:
            del module.layers[name]
    if not is_first:
        module.tok_embeddings = None
    if not is_last:
        module.norm = None
        module.output = None
    return module


@dataclass
class Pipeline:
    """This rank's share of a pipeline: its stage modules and the schedule driving them."""

    schedule: Any
    stages: list[PipelineStage]
    modules: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    n_stages: int = 1
    group: Any = None  # the pp process group
    tied_group: Any = None  # first + last stage ranks of this pipeline, when embeddings are tied
    _target_spec: list[tuple[str, torch.dtype]] = field(default_factory=list)

    def tied_params(self) -> list[nn.Parameter]:
        """This rank's copies of a tied embedding/output weight (first: embedding, last: output)."""
        if self.tied_group is None:
            return []
        out = []
        for m in self.modules:
            if m.tok_embeddings is not None:
                out.append(m.tok_embeddings.weight)
            if m.output is not None:
                out.append(m.output.weight)
        return out

    def sync_tied_grads(self) -> None:
        """Sum the tied weight's gradient over its two stages (after backward, before clipping)."""
        for p in self.tied_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=self.tied_group)

    def duplicate_params(self) -> list[nn.Parameter]:
        """Parameters that repeat another stage's (the last stage's tied output): scaled by
        clipping, not counted in the norm."""
        if self.tied_group is None or not self.has_last_stage:
            return []
        return [m.output.weight for m in self.modules if m.output is not None]

    @torch.no_grad()
    def forward_only(
        self,
        microbatches: list[torch.Tensor],
        on_output: Callable[[int, torch.Tensor], None],
        *,
        device: torch.device,
    ) -> None:
        """Run each microbatch through all stages in order; ``on_output(i, out)`` on the last stage.

        Every rank of the pipeline calls this with the same number of
        microbatches (inputs are read on the first stage only). Activations
        move with blocking point-to-point sends, shape first.
        """
        pp = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        by_id = {st.stage_index: m for st, m in zip(self.stages, self.modules)}
        for i, x in enumerate(microbatches):
            h = x
            for sid in range(self.n_stages):
                if sid % pp != me:
                    continue
                prev, nxt = (sid - 1) % pp, (sid + 1) % pp
                if sid > 0 and prev != me:  # else h is this rank's previous stage's output
                    head = torch.zeros(4, dtype=torch.long, device=device)  # 3 dims + dtype
                    dist.recv(head, group_src=prev, group=self.group)
                    *shape, code = head.tolist()
                    h = torch.empty(tuple(shape), dtype=_DTYPES[code], device=device)
                    dist.recv(h, group_src=prev, group=self.group)
                h = by_id[sid](h)
                if sid == self.n_stages - 1:
                    on_output(i, h)
                elif nxt != me:
                    h = h.contiguous()
                    head = torch.tensor(
                        [*h.shape, _DTYPES.index(h.dtype)], dtype=torch.long, device=device
                    )
                    dist.send(head, group_dst=nxt, group=self.group)
                    dist.send(h, group_dst=nxt, group=self.group)

    def step(
        self,
        *inputs: torch.Tensor,
        targets: dict[str, torch.Tensor] | None = None,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> list[torch.Tensor]:
        """Forward + backward of one batch; returns the microbatch losses (last stage only).

        Every rank calls this; ``inputs`` are used on the first stage and
        ``targets`` (dict of ``[B, ...]`` tensors) on the last stage only.
        """
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.has_last_stage:
            if targets is None:
                raise ValueError("the last pipeline stage needs targets")
            kwargs["target"] = self._pack(targets)
            kwargs["losses"] = losses
            kwargs["loss_kwargs"] = loss_kwargs
        args = inputs if self.has_first_stage else ()
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses

    def _pack(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """dict of ``[B, S]`` tensors -> ``[B, S, K]`` float64; keys and dtypes remembered."""
        keys = sorted(targets)
        shapes = {k: tuple(targets[k].shape) for k in keys}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"pipeline targets must share one shape, got {shapes}")
        self._target_spec[:] = [(k, targets[k].dtype) for k in keys]
        return torch.stack([targets[k].to(torch.float64) for k in keys], dim=-1)

    def unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """One microbatch of packed targets -> dict with the original dtypes."""
        out = {}
        for i, (k, dtype) in enumerate(self._target_spec):
            t = packed[..., i]
            is_int = not (dtype.is_floating_point or dtype.is_complex)
            out[k] = (t.round() if is_int else t).to(dtype)
        return out


def build_pipeline(
    model: nn.Module | Callable[[], nn.Module],
    pp_mesh: DeviceMesh,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: LossFn,
    *,
    device: torch.device,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> Pipeline:
    """Stage modules for this pp rank + a schedule; see the module docstring.

    ``model`` is a meta-device Transformer (copied per stage) or a factory making
    one. ``parallelize_fn(stage_module)`` must return the stage ready to run:
    parallelized and materialised on ``device`` (weights loaded). ``loss_fn(output,
    targets: dict, **loss_kwargs) -> scalar`` runs on the last stage.
    """
    spr = _stages_per_rank(schedule_name)
    pp = pp_mesh.size()
    # A factory is called once per stage; the first call doubles as the probe for sizes.
    probe = model if isinstance(model, nn.Module) else model()
    spare = [] if isinstance(model, nn.Module) else [probe]
    args, n_layers = probe.args, len(probe.layers)
    if n_microbatches < pp:
        raise ValueError(
            f"pipeline needs n_microbatches >= pp, got n_microbatches={n_microbatches}, pp={pp}"
        )
    if spr > 1 and n_microbatches % pp:
        raise ValueError(
            f"{schedule_name} needs n_microbatches divisible by pp={pp}, got {n_microbatches}"
        )
    split = pipeline_split(args, pp, n_layers, stages_per_rank=spr)
    n_stages = len(split)
    rank = pp_mesh.get_local_rank()
    group = pp_mesh.get_group()
    ids = stage_ids_for_rank(rank, pp, spr)

    modules, stages = [], []
    for sid in ids:
        source: Any = spare.pop() if spare else model
        module = _make_stage_module(source, split[sid], sid == 0, sid == n_stages - 1)
        if parallelize_fn is not None:
            module = parallelize_fn(module)
        modules.append(module)
        stages.append(PipelineStage(module, sid, n_stages, device, group=group))

    pipe = Pipeline(
        schedule=None,
        stages=stages,
        modules=modules,
        has_first_stage=0 in ids,
        has_last_stage=(n_stages - 1) in ids,
        n_stages=n_stages,
        group=group,
        tied_group=_ends_group(pp_mesh)
        if pp > 1 and getattr(args, "tie_word_embeddings", False)
        else None,
    )

    def packed_loss(output: torch.Tensor, packed: torch.Tensor, **kw: Any) -> torch.Tensor:
        return loss_fn(output, pipe.unpack(packed), **kw)

    cls = SCHEDULES[schedule_name][0]
    stage_arg: Any = stages if spr > 1 else stages[0]
    pipe.schedule = cls(
        stage_arg, n_microbatches=n_microbatches, loss_fn=packed_loss, scale_grads=False
    )
    return pipe


def _ends_group(pp_mesh: DeviceMesh) -> Any:
    """Process group of the first and the last pp rank of this rank's pipeline.

    Collective over the world (``new_group`` for every pipeline, in order).
    Ranks holding neither end get None.
    """
    lines = mesh_lines(pp_mesh._get_root_mesh(), ("pp",))
    return new_groups([[line[0], line[-1]] for line in lines])
