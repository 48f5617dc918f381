"""The one FSDP2 rule of tandem/parallel/parallelize.py (`fsdp_needed`), on one CPU rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


def test_one_fsdp_rule_for_every_model():
    """FSDP2 wraps a model when there are data-parallel ranks or when mixed precision is asked
    for, so a one-rank run (or pp x tp = world) on a GPU still computes in bfloat16; a
    one-rank float32 run is left unsharded."""
    from torch.distributed.fsdp import FSDPModule

    from tandem.models.flavors import get_flavor
    from tandem.models.transformer import Transformer
    from tandem.parallel.distributed import init_distributed
    from tandem.parallel.mesh import Degrees, build_mesh
    from tandem.parallel.parallelize import parallelize

    info = init_distributed(force_cpu=True)
    try:
        mesh = build_mesh(Degrees(pp=1, dp_replicate=1, dp_shard=1, tp=1), info.device)
        args = get_flavor("debug-qwen3")
        for dtype, sharded in (("float32", False), ("bfloat16", True)):
            with torch.device("meta"):
                model = Transformer(args)
            parallelize(model, mesh, param_dtype=dtype)
            assert isinstance(model, FSDPModule) is sharded
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, mesh, cpu_offload=True)
        assert isinstance(model, FSDPModule)
        # and a bfloat16 forward through the one-rank FSDP2 unit computes in bfloat16
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, mesh, param_dtype="bfloat16")
        model.to_empty(device="cpu")
        model.init_weights(0)
        model.reset_rope()
        seen = []
        model.layers["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        model(torch.zeros(1, 4, dtype=torch.long))
        assert seen == [torch.bfloat16]
    finally:  # the next test module may set up a process group of its own
        dist.destroy_process_group()
