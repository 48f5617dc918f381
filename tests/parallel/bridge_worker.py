"""torchrun worker (3 CPU ranks) for tests/parallel/test_split_bridge.py: rank 0 receives, ranks
1 and 2 hold FSDP-style Shard(0) shards of two tensors (one of uneven rows) and send them over a
split world's bridge group in several buckets; every rank's findings go to ``--out``."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tandem.parallel.checksum import MOD, box_checksum
from tandem.parallel.mesh import Degrees
from tandem.parallel.reshard import Box, Resharder, held
from tandem.parallel.split import BridgeMismatch, check_bridge, side_mesh, split_world

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
out_path = p.parse_args().out
dist.init_process_group("gloo")
w = split_world(1)
mesh = side_mesh(Degrees(dp_shard=2), torch.device("cpu"), 1)
gen = torch.Generator().manual_seed(0)
full = {"a.weight": torch.randn(5, 3, generator=gen), "b.bias": torch.randn(7, generator=gen)}
shapes = {k: tuple(t.shape) for k, t in full.items()}
sources, holds, needs = {}, {}, {}
if w.in_first:
    needs = {k: (Box.whole(s), s) for k, s in shapes.items()}
else:
    for k, t in full.items():
        local = t.chunk(2)[w.side_rank].clone()
        d = DTensor.from_local(
            local, mesh["dp_shard"], [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
        )
        sources[k], holds[k] = held(d)
plan = Resharder(shapes, holds, needs, 4, bucket_bytes=64, group=w.bridge)
moved, stats = plan.run(sources, torch.float32, torch.device("cpu"))
found = {
    "rank": w.rank,
    "collectives": stats.collectives,
    "sent": stats.bytes_sent,
    "equal": all(torch.equal(moved[k], full[k]) for k in moved),
    "got": sorted(moved),
}
found["checksum"] = check_bridge(plan, sources, moved, torch.float32)
found["reference"] = (
    sum(box_checksum(k, t, (0,) * t.dim(), tuple(t.shape)) for k, t in full.items()) % MOD
)
if w.in_first:
    moved["a.weight"].view(torch.int32)[1, 1] ^= 1  # one bit of one element
try:
    check_bridge(plan, sources, moved, torch.float32)
    found["mismatch"] = None
except BridgeMismatch as e:
    found["mismatch"] = str(e)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, found)
if dist.get_rank() == 0:
    torch.save(every, out_path)
dist.barrier()
dist.destroy_process_group()
