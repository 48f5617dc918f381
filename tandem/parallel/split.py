"""A world split in two: the first G ranks run one job, the other ranks another, concurrently.

`split_world` makes, once and on every rank (``new_group`` is collective over the world):

- ``first``: the group of ranks ``0 .. G-1`` (None when G = 1);
- ``second``: the group of ranks ``G .. W-1`` (a group even of one rank), which the second
  side's collectives take as their group;
- ``bridge``: every rank, for the weight move from the second side to the first: a
  `tandem.parallel.reshard.Resharder` over it, planned once, moves each region from the rank
  that holds it (every holder sends its own shard, no single sender) in buckets;
- ``control``: every rank, on gloo (CPU), for point-to-point messages between the sides.

`side_mesh` lays a device mesh over the second side's ranks only, and `check_bridge` compares,
by the exact checksum of tandem/parallel/checksum.py, what the receivers hold with what the
senders hold (`BridgeMismatch` when any tensor differs). `BridgeCopy` is a generation copy
(tandem/parallel/generation_layout.py) filled over the bridge: the second side's shards are
the sources, the first side builds and refills whole copies. Nothing here knows what runs on
either side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout, needed_box
from tandem.parallel.mesh import AXES, Degrees
from tandem.parallel.reshard import Resharder


class BridgeMismatch(RuntimeError):
    """What the receivers of a bridge move hold differs from what the senders hold."""


@dataclass(frozen=True)
class SplitWorld:
    """This rank's place in a world of ``first`` ranks ``0 .. first-1`` and the rest."""

    first: int  # G, the ranks of the first side
    world: int
    rank: int
    first_group: dist.ProcessGroup | None  # None when it is one rank
    second_group: dist.ProcessGroup | None  # None on the first side
    bridge: dist.ProcessGroup
    control: dist.ProcessGroup

    @property
    def in_first(self) -> bool:
        return self.rank < self.first

    @property
    def second(self) -> int:
        return self.world - self.first

    @property
    def side_rank(self) -> int:
        """This rank's index on its own side."""
        return self.rank if self.in_first else self.rank - self.first


def split_world(first: int) -> SplitWorld:
    """Collective (every rank, once): the groups of a world whose first ``first`` ranks form
    one side."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= first < world:
        raise ValueError(f"a split of {first} rank(s) leaves no rank on one side of {world}")
    groups = []
    for i, ranks in enumerate((list(range(first)), list(range(first, world)))):
        g = dist.new_group(ranks)
        groups.append(g if rank in ranks and (len(ranks) > 1 or i == 1) else None)
    bridge = dist.new_group(list(range(world)))
    control = dist.new_group(list(range(world)), backend="gloo")
    return SplitWorld(first, world, rank, groups[0], groups[1], bridge, control)


def side_mesh(degrees: Degrees, device: torch.device, first_rank: int) -> DeviceMesh:
    """Collective (every rank of the world): the mesh of ``degrees`` (tandem/parallel/mesh.py's
    axes) over ranks ``first_rank .. first_rank + degrees.world_size - 1``; a rank outside it
    holds the object but no coordinate."""
    shape = tuple(getattr(degrees, a) for a in AXES)
    ranks = torch.arange(first_rank, first_rank + degrees.world_size).view(shape)
    return DeviceMesh(device.type, ranks, mesh_dim_names=AXES)


def check_bridge(
    plan: Resharder,
    sources: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> int:
    """Collective over the plan's group: the checksum of everything moved (the same on every
    rank); `BridgeMismatch` on every rank when what some receiver holds in ``targets`` differs
    from the senders' ``sources`` (cast to ``dtype``)."""
    total, wrong = plan.verify(sources, targets, dtype)
    if wrong:
        raise BridgeMismatch(
            f"weight sync: {len(wrong)} tensor(s) differ between the senders and "
            f"the receivers after the move (checksum), first {wrong[0]!r}"
        )
    return total


class BridgeCopy(GenerationCopy):
    """A generation copy across a split world's bridge group: the second side's shards
    (``module``) are the sources; the first side (an empty ``module``) builds a whole copy once
    and refills it in place afterwards."""

    def __init__(
        self,
        module: nn.Module,
        args: Any,
        device: torch.device,
        dtype: torch.dtype,
        *,
        world: SplitWorld,
        bucket_bytes: int,
    ) -> None:
        super().__init__(module, args, GenerationLayout(), device, dtype, bucket_bytes=bucket_bytes)
        self.world = world

    def _make_plans(self, moving: dict[str, tuple[int, ...]], srcs: dict[str, Any]) -> Resharder:
        needs = (
            {n: needed_box(n, shape, self.layout) for n, shape in moving.items()}
            if self.world.in_first
            else {}
        )
        elem = torch.empty((), dtype=self.dtype).element_size()
        return Resharder(
            moving,
            {n: b for n, (_, b) in srcs.items()},
            needs,
            elem,
            bucket_bytes=self.bucket_bytes,
            group=self.world.bridge,
        )

    def send(self) -> dict[str, float]:
        """Collective over the bridge (a sender): this rank's shards out, then the checksum."""
        moving = self._moving()
        srcs = {n: s for n, s in self._held().items() if n in moving}
        _, stats = self._move(moving, srcs, None, None)
        t0 = time.monotonic()
        total = check_bridge(
            self._plans[False], {n: t for n, (t, _) in srcs.items()}, {}, self.dtype
        )
        return {
            "split/sync_s": stats.seconds,
            "split/check_s": time.monotonic() - t0,
            "split/sync_checksum": float(total),
        }

    def receive(self, gen: Any) -> tuple[Any, dict[str, float]]:
        """Collective over the bridge (a receiver): the senders' weights into ``gen`` (None:
        build it), then the checksum against the senders'."""
        if gen is None:
            gen, metrics = self.build()
        else:
            metrics = self.refill(gen)
        t0 = time.monotonic()
        total = check_bridge(self._plans[False], {}, gen.refill_views, self.dtype)
        return gen, {
            "split/sync_s": metrics["reshard/seconds"],
            "split/check_s": time.monotonic() - t0,
            "split/sync_checksum": float(total),
        }
