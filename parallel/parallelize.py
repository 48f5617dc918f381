"""Apply every parallelism to a model (or one pipeline stage) in the one fixed order.

TP -> activation checkpointing -> per-block compile -> FSDP2. The order matters:
TP must see the plain ``nn.Linear`` modules, checkpointing wraps the
TP-sharded blocks, compile sees the wrapped blocks, and FSDP2 goes last so
its all-gathers / reduce-scatters wrap (and stay outside) everything else.

For pipeline parallelism the trainer first calls `parallel.pp.build_pipeline`,
passing ``parallelize_fn=lambda m: materialise(parallelize(m, mesh, ...))``, so
each stage module is parallelized exactly like a whole model.

FSDP2 is applied when the data-parallel size (dp_replicate * dp_shard) is > 1,
over ``mesh["dp_shard"]`` or, for HSDP, the 2-D ``mesh["dp_replicate",
"dp_shard"]``. With a single data-parallel rank there is nothing to shard or
reduce, so the model is left unsharded (TP/PP still apply).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.ac import apply_ac
from parallel.compile import apply_compile
from parallel.fsdp import apply_fsdp
from parallel.mesh import dp_mesh
from parallel.tp import apply_tp

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    tp_enabled: bool = True,
    sequence_parallel: bool = True,
    vocab_parallel: bool = True,
    ac: str = "none",
    compile: bool = False,
    compile_backend: str = "inductor",
    fsdp_enabled: bool = True,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Parallelize ``model`` in place over ``mesh`` (axes from parallel/mesh.py); returns it.

    ``tp_enabled`` / ``fsdp_enabled`` let a caller switch a stage off even when
    its mesh axis is > 1 (they default to "whenever the axis is > 1").
    """
    if tp_enabled and mesh["tp"].size() > 1:
        apply_tp(
            model, mesh["tp"], sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel
        )
    apply_ac(model, ac)
    if compile:
        apply_compile(model, backend=compile_backend)
    if fsdp_enabled and mesh["dp_replicate"].size() * mesh["dp_shard"].size() > 1:
        apply_fsdp(
            model,
            dp_mesh(mesh),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
        )
    return model
