"""FSDP2 over the data-parallel mesh, applied from outside the model.

Gradient reduction: FSDP2 averages gradients over the data-parallel ranks on
every backend, gloo included (no custom divide factor: gloo has no PREMUL_SUM), so
trainers normalise each rank's loss by the *global* token count and multiply
by the data-parallel size; the averaged gradient is then the gradient of the
global token-mean loss, whatever the layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, norm, head).

    ``model.layers`` must be a ModuleDict/ModuleList of blocks. Mixed precision
    casts parameters to ``param_dtype`` for compute and reduces gradients in
    ``reduce_dtype``; the sharded master copy stays in the model's dtype.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    kwargs: dict = {"mesh": mesh, "mp_policy": mp, "ignored_params": ignored_params or None}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = (
        list(model.layers.values())
        if isinstance(model.layers, nn.ModuleDict)
        else list(model.layers)
    )
    for block in blocks:
        # Every block reshards after forward, the last one too: keeping it unsharded
        # would save one all-gather per step, but a forward with no backward (old or
        # reference log-probs, scoring) would then leave stale unsharded copies behind.
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model
