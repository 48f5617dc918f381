"""`Tally`: metrics that declare how they combine, over rounds (merge) and over ranks (reduce)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.rl.core.metrics import Tally


def test_merge_adds_sums_weights_means_and_keeps_maxima():
    a = Tally().sum("errors", 2).mean("acc", 0.5, 4).max("len", 7).local("gb", 1.0)
    b = Tally().sum("errors", 1).mean("acc", 1.0, 2).max("len", 3).local("gb", 2.0)
    a.local("s", 1.5, add=True)
    b.local("s", 0.5, add=True)
    v = a.merge(b).values()
    assert v == {"errors": 3.0, "acc": (0.5 * 4 + 1.0 * 2) / 6, "len": 7.0, "gb": 2.0, "s": 2.0}


def _worker(rank: int, world: int, path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    t = Tally().sum("errors", rank + 1).mean("acc", [0.25, 1.0][rank], [3, 1][rank])
    t.max("len", [5, 9][rank])
    t.local("gb", float(rank))
    if rank == 1:
        t.sum("only_on_1", 4)  # a key one rank never saw still reduces
    out[rank] = t.reduce()
    dist.destroy_process_group()


def test_reduce_over_ranks_uses_each_declared_reduction(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
    for rank in (0, 1):
        got = out[rank]
        assert got["errors"] == 3.0 and got["only_on_1"] == 4.0
        assert got["acc"] == pytest.approx((0.25 * 3 + 1.0 * 1) / 4)
        assert got["len"] == 9.0 and got["gb"] == float(rank)  # local: this rank's own
