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

from tandem.models.lora import LoraSpec, is_adapter
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout
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
    and refills it in place afterwards.

    With LoRA adapters (``lora``, the same spec on both sides) the first sync moves the whole
    model and the generators build it, base and adapters unmerged, once; every later sync moves
    the adapters alone (`GenerationCopy`'s adapter plan, over the bridge) and checks them by the
    exact checksum (`BridgeMismatch` on any difference)."""

    def __init__(
        self,
        module: nn.Module,
        args: Any,
        device: torch.device,
        dtype: torch.dtype,
        *,
        world: SplitWorld,
        bucket_bytes: int,
        lora: LoraSpec | None = None,
    ) -> None:
        super().__init__(
            module, args, GenerationLayout(), device, dtype, bucket_bytes=bucket_bytes, lora=lora
        )
        self.world = world

    def _needs(self, moving: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return super()._needs(moving) if self.world.in_first else {}

    def _resharder(self, shapes: dict, boxes: dict, needs: dict) -> Resharder:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return Resharder(
            shapes, boxes, needs, elem, bucket_bytes=self.bucket_bytes, group=self.world.bridge
        )

    def _check(
        self, srcs: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """Collective over the bridge: the adapters' checksum (`BridgeMismatch` on a
        difference)."""
        assert self._adapter_plan is not None
        t0 = time.monotonic()
        total = check_bridge(self._adapter_plan, srcs, adapters, self.dtype)
        return {"lora/adapter_checksum": float(total), "lora/check_seconds": time.monotonic() - t0}

    def send(self) -> dict[str, float]:
        """Collective over the bridge (a sender): this rank's shards out, then the checksum
        (with adapters, after the first sync: the adapters alone)."""
        held = self._held()
        if self._adapter_plan is not None:  # LoRA, after the first sync
            srcs = {n: t for n, (t, _) in held.items() if is_adapter(n)}
            _, stats = self._adapter_plan.run(srcs, self.dtype, self.device)
            return _sync_metrics(stats.seconds, *_adapter_check(self._check(srcs, {})))
        moving = self._moving()
        srcs = {n: s for n, s in held.items() if n in moving}
        _, stats = self._move(moving, srcs, None, None)
        sources = {n: t for n, (t, _) in srcs.items()}
        if self.lora is not None:  # as the receivers' `build` does
            self._check({n: t for n, t in sources.items() if is_adapter(n)}, {})
        return _sync_metrics(stats.seconds, *self._check_all(sources, {}))

    def receive(self, gen: Any) -> tuple[Any, dict[str, float]]:
        """Collective over the bridge (a receiver): the senders' weights into ``gen`` (None:
        build it), then the checksum against the senders' (with adapters, after the first sync:
        the adapters alone, and their checksum). ``split/sync_gb``: the bytes moved into this
        generator's copy."""
        if gen is None:
            gen, metrics = self.build()
            check = self._check_all({}, gen.refill_views)
        elif self.lora is not None:
            metrics = self.refill(gen)  # the adapters and their checksum (`_check`)
            check = _adapter_check(metrics)
        else:
            metrics = self.refill(gen)
            check = self._check_all({}, gen.refill_views)
        out = _sync_metrics(metrics["reshard/seconds"], *check)
        return gen, {**out, "split/sync_gb": metrics["reshard/gb"]}

    def _check_all(
        self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
    ) -> tuple[float, float]:
        """Collective over the bridge: the checksum of everything the first sync moved, and its
        seconds."""
        t0 = time.monotonic()
        total = check_bridge(self._plans[False], sources, targets, self.dtype)
        return float(total), time.monotonic() - t0


def _adapter_check(metrics: dict[str, float]) -> tuple[float, float]:
    return metrics["lora/adapter_checksum"], metrics["lora/check_seconds"]


def _sync_metrics(seconds: float, total: float, check_s: float) -> dict[str, float]:
    return {"split/sync_s": seconds, "split/check_s": check_s, "split/sync_checksum": total}
