"""Batch-wide advantage statistics (tandem/rl/algorithms/advantages.py): REINFORCE++ and GAE
whitening over the whole rollout batch, whichever ranks hold its samples, against a
written-out formula."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.rl.algorithms import ADVANTAGES, AdvantageConfig, AdvantageInput


def _batch(seed: int = 0, n: int = 8, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    values = torch.randn(n, t, generator=g, dtype=torch.float64)
    return scores, mask, values


def _advantages(name: str, scores, mask, values, reduce_sum=None):
    inp = AdvantageInput(
        scores=scores,
        mask=mask,
        values=values,
        reduce_sum=reduce_sum,
        group_index=torch.arange(len(scores)) // 2,
    )
    return ADVANTAGES.get(name)(inp, AdvantageConfig(gamma=0.9, lam=0.8)).advantages


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    scores, mask, values = _batch()
    half = slice(rank * 4, rank * 4 + 4)

    def reduce_sum(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    for name in ("reinforce_pp", "gae"):
        adv = _advantages(name, scores[half], mask[half], values[half], reduce_sum)
        torch.save(adv, os.path.join(out_dir, f"{name}-{rank}.pt"))
    dist.destroy_process_group()


def test_batch_wide_advantages_do_not_depend_on_the_number_of_ranks(tmp_path):
    """REINFORCE++ and GAE whitening over the whole rollout batch: the same scores split over
    two gloo ranks give, row for row, the advantages one rank computes over all of them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    scores, mask, values = _batch()
    for name in ("reinforce_pp", "gae"):
        whole = _advantages(name, scores, mask, values)
        split = torch.cat([torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)])
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
        # and not what each half alone would give (the test would pass trivially otherwise)
        alone = torch.cat(
            [_advantages(name, scores[h], mask[h], values[h]) for h in (slice(0, 4), slice(4, 8))]
        )
        assert not torch.allclose(alone, whole)


def test_whitening_matches_the_written_out_formula():
    scores, mask, values = _batch(3)
    adv = _advantages("reinforce_pp", scores, mask, values)
    # G_t = sum_{k >= t} 0.9^(k - t) r_k over masked tokens, r = score at the last masked token
    ret = torch.zeros_like(mask)
    for i in range(len(scores)):
        pos = mask[i].nonzero().flatten().tolist()
        for j, t in enumerate(pos):
            ret[i, t] = scores[i] * 0.9 ** (len(pos) - 1 - j)
    sel = ret[mask.bool()]
    want = (ret - sel.mean()) / (sel.std() + 1e-6) * mask
    torch.testing.assert_close(adv, want)
