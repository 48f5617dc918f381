"""torchrun worker (3 CPU ranks) for tests/parallel/test_split_bridge.py: rank 0 generates, ranks
1 and 2 hold a LoRA policy sharded by FSDP2 and send it over a split world's bridge
(`BridgeCopy` with ``lora``): a first sync of the whole model, an adapter-only sync after an
optimizer-like step on the adapters, then a sync whose move corrupts one bit of one adapter on
the receiver. Every rank's findings go to ``--out``."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tandem.models.lora import is_adapter
from tandem.models.transformer import Transformer
from tandem.parallel.checksum import MOD, box_checksum
from tandem.parallel.mesh import Degrees
from tandem.parallel.split import BridgeCopy, BridgeMismatch, side_mesh, split_world
from tests.rollout.test_lora_refill import ARGS, SPEC, _policy


def policy(step: float) -> Transformer:
    """The trainers' model, whole: test_lora_refill's seeded base and adapters, adapters +
    ``step``."""
    model = _policy()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.add_(step)
    return model


p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
out_path = p.parse_args().out
dist.init_process_group("gloo")
w = split_world(1)
mesh = side_mesh(Degrees(dp_shard=2), torch.device("cpu"), 1)
cpu, f32 = torch.device("cpu"), torch.float32
if w.in_first:
    bridge = BridgeCopy(torch.nn.Module(), ARGS, cpu, f32, world=w, bucket_bytes=1 << 20, lora=SPEC)
else:
    model = policy(0.0)
    fully_shard(model, mesh=mesh["dp_shard"])
    bridge = BridgeCopy(model, ARGS, cpu, f32, world=w, bucket_bytes=1 << 20, lora=SPEC)


def sync(gen):
    return bridge.receive(gen) if w.in_first else (None, bridge.send())


found: dict = {"rank": w.rank}
gen, first = sync(None)
if not w.in_first:
    with torch.no_grad():  # an optimizer step on the adapters (the base is frozen)
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.add_(0.01)
base = {n: p for n, p in gen.named_parameters() if not is_adapter(n)} if gen is not None else {}
_, second = sync(gen)
found["first"], found["second"] = first, second
reference = policy(0.01)
found["adapter_bytes"] = sum(
    p.numel() * 4 for n, p in reference.named_parameters() if is_adapter(n)
)
found["model_bytes"] = sum(p.numel() * 4 for p in reference.parameters())  # untied
found["reference_checksum"] = (
    sum(
        box_checksum(n, p.detach(), (0,) * p.dim(), tuple(p.shape))
        for n, p in reference.named_parameters()
        if is_adapter(n)
    )
    % MOD
)
if gen is not None:
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        found["equal"] = torch.equal(gen(x), reference(x))
    found["base_kept"] = all(p is base[n] for n, p in gen.named_parameters() if not is_adapter(n))
    plan = bridge._adapter_plan
    run = plan.run

    def corrupting(*a, **k):  # the move delivers one flipped bit of one adapter
        state, stats = run(*a, **k)
        state["layers.1.feed_forward.w2.lora_B.weight"].view(torch.int32)[0, 0] ^= 1
        return state, stats

    plan.run = corrupting
try:
    sync(gen)
    found["mismatch"] = None
except BridgeMismatch as e:
    found["mismatch"] = str(e)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, found)
if dist.get_rank() == 0:
    torch.save(every, out_path)
dist.barrier()
dist.destroy_process_group()
