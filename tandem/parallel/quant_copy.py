"""A low-bit generation copy's side of the reshard (rollout.weight_dtype, docs/low-precision.md).

The weights move in the copy's dtype; `on_arrival` is the reshard's ``done`` callback that
quantizes each target weight on the receiving rank as soon as its last region has landed,
so no more than a bucket of them is held in full precision at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.device import collective_device
from tandem.kernels.weight_quant import WeightFormat, quantize
from tandem.models.quant_linear import is_target_weight


def on_arrival(
    fmt: WeightFormat,
    sink: dict[str, Any],
    rest: dict[str, torch.Tensor],
    amax: dict[str, torch.Tensor],
) -> Callable[[str, torch.Tensor], None]:
    """``done(name, tensor)``: a target weight (a shard of it, under rollout.tp > 1, whose whole
    tensor's largest entry is ``amax[name]``) is quantized into ``sink[name]`` (loaded into the
    `QuantLinear` already there, or stored as a new `QuantizedWeight`); any other tensor goes
    to ``rest``."""

    def done(name: str, t: torch.Tensor) -> None:
        if not is_target_weight(name):
            rest[name] = t
        elif isinstance(sink.get(name), nn.Module):
            sink[name].load(t, amax.get(name))
        else:
            sink[name] = quantize(t, fmt, amax.get(name))

    return done


def tensor_amax(
    fmt: WeightFormat, names: list[str], srcs: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Collective over the world (every rank, the same ``names`` in the same order), for w4a16
    only: each target weight's largest ``|entry|`` over the whole tensor, from the shards the
    trainer's ranks hold (``srcs[name] = (tensor, box)``), in the copy's ``dtype`` (rounding is
    monotonic, so this is the largest entry of the moved tensor): a generation shard then gets
    the whole tensor's scale. FP8 formats have no tensor scale: empty."""
    if fmt.bits != 4:
        return {}
    names = [n for n in names if is_target_weight(n)]
    out = torch.zeros(len(names), dtype=torch.float32)
    for i, n in enumerate(names):
        if n in srcs and srcs[n][0].numel():
            out[i] = srcs[n][0].detach().abs().amax().to(dtype).float().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        on = out.to(collective_device())
        dist.all_reduce(on, op=dist.ReduceOp.MAX)
        out = on.cpu()
    return {n: out[i] for i, n in enumerate(names)}


def quant_buffers(linears: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The low-bit buffers of each `QuantLinear` (keyed by its weight's name) under their
    state-dict names: a copy's ``load_state_dict`` is given them as they are."""
    return {
        name[: -len("weight")] + k: b
        for name, lin in linears.items()
        for k, b in lin.named_buffers()
        if b is not None
    }


def quant_metrics(linears: dict[str, Any], dtype: torch.dtype) -> dict[str, float]:
    """The low-bit projections' resident bytes (``reshard/quantized_gb``) and what the same
    weights take in ``dtype`` (``reshard/quantized_full_gb``); empty without any."""
    if not linears:
        return {}
    elem = torch.empty((), dtype=dtype).element_size()
    full = sum(m.in_features * m.out_features * elem for m in linears.values())
    return {
        "reshard/quantized_gb": sum(m.nbytes() for m in linears.values()) / 1e9,
        "reshard/quantized_full_gb": full / 1e9,
    }
