"""Apply every parallelism to a model (or one pipeline stage) in the one fixed order.

TP -> activation checkpointing -> per-block compile -> FSDP2. The order matters:
TP must see the plain ``nn.Linear`` modules, checkpointing wraps the
TP-sharded blocks, compile sees the wrapped blocks, and FSDP2 goes last so
its all-gathers / reduce-scatters wrap (and stay outside) everything else.

For pipeline parallelism the trainer first calls `parallel.pp.build_pipeline`,
passing ``parallelize_fn=lambda m: materialise(parallelize(m, mesh, ...))``, so
each stage module is parallelized exactly like a whole model.

FSDP2, over ``mesh["dp_shard"]`` or, for HSDP, the 2-D ``mesh["dp_replicate",
"dp_shard"]``, follows one rule for every model and pipeline stage: it is
applied when there are data-parallel ranks to shard over (dp_replicate *
dp_shard * cp > 1: under context parallelism FSDP2 shards over ``dp_shard x
cp``), or when mixed precision or CPU offload is asked for, since FSDP2's
policies are how those are done (so a one-GPU run, or a layout with pp x tp =
world, still computes in ``param_dtype``). Otherwise (one
data-parallel rank computing in float32) the model is left unsharded.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.parallel.ac import apply_ac
from tandem.parallel.compile import apply_compile
from tandem.parallel.expert_parallel import apply_ep, expert_params
from tandem.parallel.fsdp import apply_fsdp
from tandem.parallel.lora import check_lora_layout
from tandem.parallel.mesh import dp_mesh
from tandem.parallel.tp import apply_tp

__all__ = ["fsdp_needed", "parallelize"]


def fsdp_needed(mesh: DeviceMesh, *, param_dtype: str, cpu_offload: bool) -> bool:
    """The FSDP2 rule: data-parallel (or context-parallel) ranks to shard over, or mixed precision /
    offload asked for. cp ranks hold the same parameters and gradients of different tokens, which
    FSDP2's reduce-scatter sums (tandem/parallel/mesh.py)."""
    dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["cp"].size()
    return dp > 1 or param_dtype != "float32" or cpu_offload


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
    fsdp_enabled: bool | None = None,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    ep: int = 1,
) -> nn.Module:
    """Parallelize ``model`` in place over ``mesh`` (axes from tandem/parallel/mesh.py); returns it.

    ``ep`` > 1 shards MoE experts over groups of ``ep`` of the ``mesh["dp_shard"]`` ranks,
    replicated over the other groups and HSDP's replicas (tandem/parallel/expert_parallel.py).
    ``tp_enabled`` switches TP off even when its mesh axis is > 1; ``fsdp_enabled``
    forces FSDP2 on or off (default None: the rule in the module docstring).
    """
    tp = tp_enabled and mesh["tp"].size() > 1
    check_lora_layout(model, tp=mesh["tp"].size() if tp else 1, ep=ep)
    if tp:  # with EP the experts are split by apply_ep below, over (dp_shard, tp)
        apply_tp(
            model,
            mesh["tp"],
            sequence_parallel=sequence_parallel,
            vocab_parallel=vocab_parallel,
            shard_experts=ep == 1,
        )
    ignored = set()
    if ep > 1:
        # experts sharded over the FSDP2 ranks, left out of FSDP2
        # (tandem/parallel/expert_parallel.py)
        apply_ep(model, dp_mesh(mesh), ep, ep_tp_mesh=mesh["dp_shard", "tp"] if tp else None)
        ignored = expert_params(model)
    apply_ac(model, ac)
    if compile:
        apply_compile(model, backend=compile_backend)
    if fsdp_enabled is None:
        fsdp_enabled = fsdp_needed(mesh, param_dtype=param_dtype, cpu_offload=cpu_offload)
    if fsdp_enabled:
        apply_fsdp(
            model,
            dp_mesh(mesh),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            ignored_params=ignored,
        )
    return model
