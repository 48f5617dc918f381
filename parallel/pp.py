"""Pipeline parallelism: split a Transformer by layers into stages and schedule them.

`pipeline_split` assigns contiguous layer ranges to stages (as even as possible;
earlier stages take the remainder). `build_pipeline` makes this rank's stage
modules from a meta model (or a factory): each is a copy of the whole model with
the other layers deleted, ``tok_embeddings`` set to None off the first stage and
``norm`` / ``output`` set to None off the last; the caller's ``parallelize_fn``
then applies TP / AC / compile / FSDP and materialises each stage, and the
stages are wrapped in ``PipelineStage`` under one of three torch schedules:
"1F1B", "GPipe" (one stage per rank) or "Interleaved1F1B" (two virtual stages per
rank, looped: rank r holds stages r and r + pp).

How targets reach the last stage: torch's ``schedule.step(*inputs, target=T,
loss_kwargs=K)`` splits a *single tensor* ``T`` on dim 0 into microbatches and
calls ``loss(output_mb, T_mb, **K)`` on the last stage; ``K`` is passed whole to
every microbatch. RL losses need several per-token tensors (target ids, loss
mask, advantages, old log-probs ...), so `Pipeline.step` packs a dict of
``[B, ...]`` tensors into one float64 ``[B, S, K]`` tensor (ids below 2**53 are
exact) and the wrapped loss unpacks each microbatch back into a dict before
calling ``loss_fn(output, targets_dict, **loss_kwargs)``. Batch-global scalars
(e.g. the global token count used for normalisation) belong in ``loss_kwargs``.

Gradients are *summed* over microbatches (``scale_grads=False``): ``loss_fn``
must return each microbatch's share of the global loss (e.g. divide a token sum
by the global token count), so the accumulated gradient is that of the whole
batch whatever ``n_microbatches`` is.

Tied input/output embeddings cannot be split across stages and are rejected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

__all__ = ["SCHEDULES", "Pipeline", "build_pipeline", "pipeline_split", "stage_ids_for_rank"]

# schedule name -> (torch class, stages per rank)
SCHEDULES: dict[str, tuple[type, int]] = {
    "1F1B": (Schedule1F1B, 1),
    "GPipe": (ScheduleGPipe, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
}

LossFn = Callable[..., torch.Tensor]


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
    line) when a stage would get no layer or the embeddings are tied.
    """
    n_layers = model_args.num_layers if num_layers is None else num_layers
    n_stages = pp * stages_per_rank
    if pp < 1:
        raise ValueError(f"pipeline parallel degree must be >= 1, got pp={pp}")
    if n_stages > n_layers:
        what = f"pp={pp}" if stages_per_rank == 1 else f"pp={pp} x {stages_per_rank} virtual stages"
        raise ValueError(
            f"pipeline parallel {what} needs at least {n_stages} layers, model has num_layers={n_layers}"
        )
    if pp > 1 and getattr(model_args, "tie_word_embeddings", False):
        raise ValueError(
            "pipeline parallelism does not support tied input/output embeddings "
            "(tie_word_embeddings=True); use pp=1 or an untied model"
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
    _target_spec: list[tuple[str, torch.dtype]] = field(default_factory=list)

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
    )

    def packed_loss(output: torch.Tensor, packed: torch.Tensor, **kw: Any) -> torch.Tensor:
        return loss_fn(output, pipe.unpack(packed), **kw)

    cls = SCHEDULES[schedule_name][0]
    stage_arg: Any = stages if spr > 1 else stages[0]
    pipe.schedule = cls(
        stage_arg, n_microbatches=n_microbatches, loss_fn=packed_loss, scale_grads=False
    )
    return pipe
