"""Move named tensors from the layout that holds them to the layout that needs them.

Every rank holds some regions ("boxes") of some global tensors: a DTensor's local
shard under FSDP2 / HSDP / TP, a pipeline stage's layers, or a plain tensor (the
whole of it). Every rank needs other boxes of them: its shard of a generation
layout, or the whole tensor. `Resharder` works out, once, who sends which region
to whom (a rank that holds what it needs keeps its own copy; replicas share the
sending), and then moves the tensors in collectives of at most ``bucket_bytes``
of send plus receive buffers per rank. Only the regions a rank needs travel, cast
to the target dtype on the sender, so no rank ever holds a full tensor it does not
need: the transient cost of a move is one bucket.

The same plan serves every move between the same two layouts (the recipe keeps
the `Resharder` for the run). Nothing here knows what the tensors are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tandem.parallel.checksum import MOD, box_checksum


@dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor: ``offset`` and ``size`` per dimension."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offset, self.size, other.offset, other.size)
        )
        if any(h <= a for a, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - a for a, h in zip(lo, hi)))

    def rows(self, start: int, stop: int) -> Box | None:
        """The part of this box whose dim-0 index is in ``[start, stop)``."""
        if not self.size:
            return self if start == 0 else None
        return self.intersect(Box((start,) + self.offset[1:], (stop - start,) + self.size[1:]))

    def index_in(self, outer: Box) -> tuple[slice, ...]:
        """Slices selecting this box out of a tensor that holds ``outer`` (this box inside it)."""
        return tuple(
            slice(o - p, o - p + n) for o, n, p in zip(self.offset, self.size, outer.offset)
        )


def held(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The data this rank holds of ``t`` (a view, no copy) and where it sits in the
    global tensor."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} != computed {tuple(shape)}")
        return local, Box(tuple(offset), tuple(shape))
    return t, Box.whole(tuple(t.shape))


@dataclass(frozen=True)
class _Move:
    """One region of one tensor, from ``src`` rank to ``dst`` rank."""

    name: str
    src: int
    dst: int
    region: Box
    src_box: Box  # what the sender holds (the region is inside it)


@dataclass
class ReshardStats:
    seconds: float = 0.0
    bytes_sent: int = 0  # to other ranks, by this rank
    bytes_kept: int = 0  # copied from this rank's own shards
    collectives: int = 0
    peak_buffer_bytes: int = 0  # the largest send + receive buffers of one collective


class Resharder:
    """A fixed plan for moving ``shapes`` from the boxes ranks hold to the boxes they need.

    Collective to build (every rank of ``group``, same ``shapes`` in the same order).
    ``holds[name]``: the box this rank holds (absent: nothing). ``needs[name]``: the box
    this rank needs, and the shape of the local tensor it goes into (placed at index 0 of
    every dimension; the rest, e.g. vocabulary padding, is zero). ``bucket_bytes`` bounds
    one collective's send plus receive buffers on every rank; a tensor bigger than that
    moves in slices of its first dimension.
    """

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        holds: dict[str, Box],
        needs: dict[str, tuple[Box, tuple[int, ...]]],
        elem_bytes: int,
        *,
        bucket_bytes: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.shapes, self.group = dict(shapes), group
        self.needs = needs
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        all_holds: list[dict[str, Box]] = [holds]
        all_needs: list[dict[str, Box]] = [{k: b for k, (b, _) in needs.items()}]
        if self.world > 1:
            all_holds, all_needs = [None] * self.world, [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(all_holds, holds, group=group)
            dist.all_gather_object(all_needs, {k: b for k, (b, _) in needs.items()}, group=group)
        # per tensor: each distinct held box and its holders
        self._holders: dict[str, dict[Box, list[int]]] = {}
        self._needed = {
            name: sorted(
                {n[name] for n in all_needs if name in n}, key=lambda b: (b.offset, b.size)
            )
            for name in self.shapes
        }  # per tensor: the distinct boxes some rank needs
        self.collectives = _bucket(
            self._moves(all_holds, all_needs), self.world, elem_bytes, bucket_bytes
        )

    def _moves(
        self, all_holds: list[dict[str, Box]], all_needs: list[dict[str, Box]]
    ) -> list[list[_Move]]:
        """Per tensor, in order: every region some rank needs, and who sends it."""
        out = []
        for name, shape in self.shapes.items():
            holders: dict[Box, list[int]] = {}
            for p, h in enumerate(all_holds):
                if name in h:
                    holders.setdefault(h[name], []).append(p)
            self._holders[name] = holders
            total = sum(b.numel for b in holders)
            if total != math.prod(shape):
                raise ValueError(
                    f"{name}: the ranks hold {total} distinct elements of a "
                    f"{shape} tensor (shards must tile it exactly once)"
                )
            moves = []
            for q, need in enumerate(all_needs):
                if name not in need:
                    continue
                for box, ranks in holders.items():
                    region = box.intersect(need[name])
                    if region is not None:
                        src = q if q in ranks else ranks[q % len(ranks)]
                        moves.append(_Move(name, src, q, region, box))
            out.append(moves)
        return out

    def run(
        self,
        sources: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        *,
        probe: Callable[[], None] | None = None,
        into: dict[str, torch.Tensor] | None = None,
        done: Callable[[str, torch.Tensor], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], ReshardStats]:
        """Collective: this rank's needed tensors (``dtype``, on ``device``), and what it cost.
        ``dtype`` must have the ``elem_bytes`` the plan was bucketed with.

        ``sources[name]``: this rank's held data of ``name`` (`held`'s first value), for every
        name it holds. ``probe()`` runs inside every collective while its buffers are live
        (memory tests measure there). ``into``: tensors (of the needed local shapes) to write
        into instead of allocating new ones: the layout is refilled in place; a name it lacks
        gets a new tensor. ``done(name, tensor)``: called once the last region of ``name`` has
        arrived, after the collective that brought it, and the tensor is then dropped from the
        result (a low-bit copy quantizes each weight as its bucket lands, so no more than a
        bucket's tensors are held in the moving dtype beyond ``into``'s)."""
        import time

        t0 = time.monotonic()
        stats = ReshardStats()
        out: dict[str, torch.Tensor] = {}
        pending: dict[str, int] = {}  # regions still to arrive, per name (with ``done``)
        for moves in self.collectives:
            for m in moves:
                if m.dst == self.rank:
                    pending[m.name] = pending.get(m.name, 0) + 1
        finished: set[str] = set()
        for moves in self.collectives:
            for m in moves:  # allocate a target the first time one of its regions arrives
                if m.dst == self.rank and m.name not in out:
                    box, local_shape = self.needs[m.name]
                    if into is not None and m.name in into:
                        out[m.name] = into[m.name]
                        have = tuple(out[m.name].shape)
                        if have != tuple(local_shape):
                            raise ValueError(
                                f"reshard into {m.name}: shape {have}, need {tuple(local_shape)}"
                            )
                    else:
                        out[m.name] = torch.zeros(local_shape, dtype=dtype, device=device)
            self._collective(moves, sources, out, dtype, device, stats, probe)
            if done is not None:
                for m in moves:
                    if m.dst == self.rank:
                        pending[m.name] -= 1
                        if pending[m.name] == 0:
                            done(m.name, out.pop(m.name))
                            finished.add(m.name)
        missing = set(self.needs) - set(out) - finished
        if missing:
            raise RuntimeError(f"reshard: nothing arrived for {sorted(missing)}")
        stats.seconds = time.monotonic() - t0
        return out, stats

    def verify(
        self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[int, list[str]]:
        """Collective: compare what every rank holds in ``targets`` (its needed box of each tensor,
        at index 0 of a possibly padded tensor) with the ``sources`` it was moved from, cast to
        ``dtype``, by the exact checksum of tandem/parallel/checksum.py. Each needed box's checksum
        is summed from the holders' intersections with it (one holder per distinct box), so no
        rank needs data it does not hold. Returns (the checksum of every distinct needed box,
        summed mod 2**32: the same on every rank) and the names whose copy differs on any rank."""
        keys = [(name, box) for name in self.shapes for box in self._needed[name]]
        expected = torch.zeros(len(keys), dtype=torch.int64)
        for i, (name, need) in enumerate(keys):
            for box, ranks in self._holders[name].items():
                region = box.intersect(need)
                if ranks[0] == self.rank and region is not None:
                    part = sources[name][region.index_in(box)].to(dtype)
                    expected[i] += box_checksum(name, part, region.offset, self.shapes[name])
        bad = torch.zeros(len(keys), dtype=torch.int64)
        index = {key: i for i, key in enumerate(keys)}
        for name, (need, _) in self.needs.items():
            data = targets[name][need.index_in(need)]
            bad[index[(name, need)]] = -box_checksum(name, data, need.offset, self.shapes[name])
        if self.world > 1:
            dist.all_reduce(expected, group=self.group)
        expected %= MOD
        for name, (need, _) in self.needs.items():  # mine == expected, or a mismatch mark
            i = index[(name, need)]
            bad[i] = int((bad[i] + expected[i]) % MOD != 0)
        if self.world > 1:
            dist.all_reduce(bad, group=self.group)
        wrong = sorted({keys[i][0] for i in bad.nonzero()[:, 0].tolist()})
        return int(expected.sum() % MOD), wrong

    def _collective(
        self,
        moves: list[_Move],
        sources: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        stats: ReshardStats,
        probe: Callable[[], None] | None,
    ) -> None:
        me = self.rank
        for m in moves:  # own copies first: no buffer
            if m.src == me and m.dst == me:
                self._place(out, m, sources[m.name][m.region.index_in(m.src_box)])
                stats.bytes_kept += m.region.numel * out[m.name].element_size()
        sends = sorted((m for m in moves if m.src == me and m.dst != me), key=lambda m: m.dst)
        recvs = sorted((m for m in moves if m.dst == me and m.src != me), key=lambda m: m.src)
        if self.world == 1 or all(m.src == m.dst for m in moves):
            # every rank knows: nothing travels
            return
        esize = torch.empty((), dtype=dtype).element_size()
        in_splits, out_splits = [0] * self.world, [0] * self.world
        for m in sends:
            in_splits[m.dst] += m.region.numel * esize
        for m in recvs:
            out_splits[m.src] += m.region.numel * out[m.name].element_size()
        send = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        at = 0
        for m in sends:
            src = sources[m.name][m.region.index_in(m.src_box)]
            n = m.region.numel * esize
            send[at : at + n].view(dtype).view(m.region.size).copy_(src)
            at += n
        stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, send.numel() + recv.numel())
        stats.bytes_sent += send.numel()
        stats.collectives += 1
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        if probe is not None:
            probe()
        del send
        at = 0
        for m in recvs:
            t = out[m.name]
            n = m.region.numel * t.element_size()
            self._place(out, m, recv[at : at + n].view(t.dtype).view(m.region.size))
            at += n

    def _place(self, out: dict[str, torch.Tensor], m: _Move, data: torch.Tensor) -> None:
        need, _ = self.needs[m.name]
        out[m.name][m.region.index_in(need)].copy_(data)


def _bucket(
    per_tensor: list[list[_Move]], world: int, elem_bytes: int, budget: int
) -> list[list[_Move]]:
    """Group the moves into collectives whose send + receive bytes stay within ``budget`` on
    every rank (moves of one tensor split by rows where one alone would not fit). Every rank
    computes the same grouping from the same global plan."""
    units: list[list[_Move]] = []
    for moves in per_tensor:
        units += _split_rows(moves, world, elem_bytes, budget)
    collectives: list[list[_Move]] = []
    load = [0] * world
    current: list[_Move] = []
    for unit in units:
        cost = _cost(unit, world, elem_bytes)
        if current and any(a + b > budget for a, b in zip(load, cost)):
            collectives.append(current)
            current, load = [], [0] * world
        current += unit
        load = [a + b for a, b in zip(load, cost)]
    if current:
        collectives.append(current)
    return collectives


def _cost(moves: list[_Move], world: int, elem_bytes: int) -> list[int]:
    cost = [0] * world
    for m in moves:
        if m.src != m.dst:
            cost[m.src] += m.region.numel * elem_bytes
            cost[m.dst] += m.region.numel * elem_bytes
    return cost


def _split_rows(moves: list[_Move], world: int, elem_bytes: int, budget: int) -> list[list[_Move]]:
    """One tensor's moves, as units that each fit ``budget`` (slices of dim 0 where needed)."""
    if not moves or max(_cost(moves, world, elem_bytes)) <= budget or not moves[0].region.size:
        return [moves] if moves else []
    lo = min(m.region.offset[0] for m in moves)
    hi = max(m.region.offset[0] + m.region.size[0] for m in moves)
    if hi - lo <= 1:
        return [moves]  # one row over budget: it moves whole (the budget is then exceeded by it)
    mid = (lo + hi) // 2
    halves = []
    for a, b in ((lo, mid), (mid, hi)):
        part = [
            _Move(m.name, m.src, m.dst, r, m.src_box)
            for m in moves
            if (r := m.region.rows(a, b)) is not None
        ]
        halves += _split_rows(part, world, elem_bytes, budget)
    return halves
