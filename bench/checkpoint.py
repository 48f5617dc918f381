"""Checkpoint save / load time of the trainer's DCP checkpoints (policy + AdamW state).

    python -m bench.checkpoint                    # world of one, CPU: quickstart size and a ~100M model
    torchrun --nproc-per-node 2 -m bench.checkpoint

Builds each model as the RL trainer does (FSDP2 over the data-parallel ranks),
gives AdamW one step so its state exists, then times `Checkpointer.save`
(blocking: the step loop waits for all of it; saves are synchronous today) and
`Checkpointer.load` into a fresh model and optimizer, and checks the loaded
weights equal the saved ones. Prints a table: parameters, checkpoint bytes on
disk, save and load seconds. Rank 0 prints; every rank takes part.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from models.args import ModelArgs
from models.flavors import get_flavor
from parallel.distributed import destroy_distributed, init_distributed
from parallel.mesh import Degrees, build_mesh
from rl.checkpoint import Checkpointer
from rl.modeling import build_sharded_model
from rl.optim import build_optimizer


def sizes(name: str) -> ModelArgs:
    if name == "quickstart":
        return get_flavor("debug-qwen3")
    return dataclasses.replace(get_flavor("tiny-qwen3"), hidden_size=768, intermediate_size=2048, num_layers=12,
                               num_heads=12, num_kv_heads=4, head_dim=64, vocab_size=32000)


def one(name: str, folder: str, info) -> tuple[int, int, float, float]:  # noqa: ANN001
    args = sizes(name)
    mesh = build_mesh(Degrees(**{"dp_replicate": 1, "dp_shard": info.world_size, "tp": 1, "pp": 1}), info.device)

    def build():
        m = build_sharded_model(args, mesh, info.device, path=None, seed=0, param_dtype="float32",
                                reduce_dtype="float32", cpu_offload=False, is_main=info.is_main)
        opt = build_optimizer(m, lr=1e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return m, opt

    model, opt = build()
    ck = Checkpointer(folder, keep_last=1)
    t0 = time.perf_counter()
    ck.save(1, model, opt, {"step": 1})
    save_s = time.perf_counter() - t0
    fresh, fresh_opt = build()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    t0 = time.perf_counter()
    ck.load(1, fresh, fresh_opt)
    load_s = time.perf_counter() - t0
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ck.path(1)) for f in fs)
    return params, nbytes, save_s, load_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="quickstart,100m")
    a = ap.parse_args()
    info = init_distributed()
    root = tempfile.mkdtemp(prefix="tandem-ckpt-bench-") if info.is_main else None
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    try:
        if info.is_main:
            print(f"{info.world_size} rank(s) on {info.device.type}; checkpoint = weights + AdamW state, fp32")
            print(f"{'model':<12}{'params':>12}{'disk MB':>10}{'save s':>9}{'load s':>9}")
        for name in a.models.split(","):
            params, nbytes, save_s, load_s = one(name, os.path.join(root, name), info)
            if info.is_main:
                print(f"{name:<12}{params:>12,}{nbytes / 2**20:>10.1f}{save_s:>9.2f}{load_s:>9.2f}")
    finally:
        dist.barrier()
        if info.is_main:
            shutil.rmtree(root, ignore_errors=True)
        destroy_distributed()


if __name__ == "__main__":
    main()
