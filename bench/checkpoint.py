"""Checkpoint save / load time of the trainer's DCP checkpoints (policy + AdamW state).

    python -m bench.checkpoint    # world of one, CPU: quickstart size and a ~100M model
    torchrun --nproc-per-node 2 -m bench.checkpoint

Builds each model as the RL trainer does (FSDP2 over the data-parallel ranks),
gives AdamW one step so its state exists, then times three saves: synchronous
(the step loop waits for all of it), asynchronous (`async_save`: the loop
waits for the copy to CPU memory, "blocking"; "total" is start to commit,
here with nothing else running) and model-only (no optimizer state); and
`Checkpointer.load` of the full checkpoint into a fresh model and optimizer by
a fresh Checkpointer, as a restarted job does (so it re-hashes every file
against SHA256SUMS first; "verify s" times that check alone), checking the
loaded weights equal the saved ones. Saves include hashing what was written.
Prints a table; the ratio column is the asynchronous save's blocking time over
the synchronous save's.
Rank 0 prints; every rank takes part.
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
from torch.distributed.tensor import DTensor

from bench.header import print_header
from tandem.models.args import ModelArgs
from tandem.models.flavors import get_flavor
from tandem.parallel.distributed import destroy_distributed, init_distributed
from tandem.parallel.mesh import Degrees, build_mesh
from tandem.rl.core.checkpoint import Checkpointer
from tandem.rl.core.modeling import BuildSpec, build_transformer
from tandem.rl.core.optim import build_optimizer


def sizes(name: str) -> ModelArgs:
    if name == "quickstart":
        return get_flavor("debug-qwen3")
    return dataclasses.replace(
        get_flavor("tiny-qwen3"),
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=32000,
    )


def one(name: str, folder: str, info) -> dict[str, float]:  # noqa: ANN001
    args = sizes(name)
    mesh = build_mesh(
        Degrees(**{"dp_replicate": 1, "dp_shard": info.world_size, "tp": 1, "pp": 1}), info.device
    )

    def build():
        m = build_transformer(args, None, 0, mesh, info.device, BuildSpec(), is_main=info.is_main)
        opt = build_optimizer(m, lr=1e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return m, opt

    def disk(ck: Checkpointer) -> int:
        return sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ck.path(1)) for f in fs
        )

    model, opt = build()
    out: dict[str, float] = {"params": sum(p.numel() for p in model.parameters())}
    ck = Checkpointer(os.path.join(folder, "sync"), keep_last=1)
    t0 = time.perf_counter()
    ck.save(1, model, opt, {"step": 1})
    out["save_s"], out["bytes"] = time.perf_counter() - t0, disk(ck)
    ack = Checkpointer(os.path.join(folder, "async"), keep_last=1, async_save=True)
    out["async_blocking_s"] = ack.save(1, model, opt, {"step": 1})
    out["async_total_s"] = ack.wait()
    mck = Checkpointer(os.path.join(folder, "model"), keep_last=1, model_only=True)
    out["model_only_s"] = mck.save(1, model, opt, {"step": 1})
    out["model_only_bytes"] = disk(mck)
    fresh, fresh_opt = build()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    t0 = time.perf_counter()
    assert Checkpointer(ck.folder).verify(1) is None
    out["verify_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    Checkpointer(ck.folder).load(1, fresh, fresh_opt)  # a restarted job: verifies, then loads
    out["load_s"] = time.perf_counter() - t0
    for a, b in zip(model.parameters(), fresh.parameters()):  # DTensor shards, or plain on one rank
        assert torch.equal(_local(a), _local(b))
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="quickstart,100m")
    ap.add_argument(
        "--smoke", action="store_true", help="the quickstart model only (the test suite's run)"
    )
    a = ap.parse_args()
    if a.smoke:
        a.models = "quickstart"
    info = init_distributed()
    root = tempfile.mkdtemp(prefix="tandem-ckpt-bench-") if info.is_main else None
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    try:
        if info.is_main:
            print_header("bench.checkpoint", device=info.device.type)
            print(
                f"{info.world_size} rank(s) on {info.device.type}; checkpoint = weights + AdamW "
                "state, fp32"
            )
            print(
                f"{'model':<12}{'params':>12}{'disk MB':>9}{'save s':>8}{'async blocking s':>18}"
                f"{'async total s':>15}{'ratio':>7}{'model-only MB':>15}{'model-only s':>14}"
                f"{'verify s':>10}{'load s':>8}"
            )
        for name in a.models.split(","):
            r = one(name, os.path.join(root, name), info)
            if info.is_main:
                print(
                    f"{name:<12}{int(r['params']):>12,}{r['bytes'] / 2**20:>9.1f}"
                    f"{r['save_s']:>8.2f}{r['async_blocking_s']:>18.2f}"
                    f"{r['async_total_s']:>15.2f}{r['async_blocking_s'] / r['save_s']:>7.2f}"
                    f"{r['model_only_bytes'] / 2**20:>15.1f}{r['model_only_s']:>14.2f}"
                    f"{r['verify_s']:>10.2f}{r['load_s']:>8.2f}"
                )
    finally:
        dist.barrier()
        if info.is_main:
            shutil.rmtree(root, ignore_errors=True)
        destroy_distributed()


if __name__ == "__main__":
    main()
