"""Pre-flight: time a matmul and a collective on every rank before a job spends its allocation.

    torchrun --nproc-per-node 8 -m tandem.diagnose --preflight [--dump DIR]

Each rank times ``repeats`` square matmuls of side ``size`` on its device (CUDA when there is
one, else CPU) and ``repeats`` all-reduces of ``numel`` floats over the world (NCCL or gloo),
keeping the median of each. Rank 0 gathers them, prints one row per rank and flags every rank
whose matmul is slower than ``ratio`` times the median rank's (a throttled or faulty device,
a noisy neighbour on the host), naming its host; the last line lists the flagged hosts in the
form Slurm's ``--exclude`` takes. A collective is as slow as its slowest member, so its time
is the same on every rank of one job; it is printed to compare jobs and networks. With
``dump``, the rows go to ``<dump>/preflight.json``. Returns the flagged ranks.

TANDEM_INJECT_SLOW=<rank>:<s> (the straggler drill) adds s seconds to that rank's matmuls.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem import device as seam
from tandem.rl.fault.inject import slow_seconds


def _median_s(fn: Any, repeats: int, sync: Any) -> float:
    fn()  # warm-up
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(size: int, numel: int, repeats: int) -> dict[str, Any]:
    """This rank's matmul and all-reduce medians (collective: every rank calls it)."""
    rank = dist.get_rank()
    device = seam.collective_device()  # the accelerator when the group's backend is its own
    sync = lambda: seam.synchronize(device)  # noqa: E731
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    extra = slow_seconds(rank)

    def matmul() -> None:
        a @ b
        if extra:
            time.sleep(extra)

    buf = torch.ones(numel, device=device)
    mm = _median_s(matmul, repeats, sync)
    dist.barrier()
    ar = _median_s(lambda: dist.all_reduce(buf), repeats, sync)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "device": str(device),
        "matmul_s": mm,
        "matmul_tflops": 2 * size**3 / mm / 1e12,
        "all_reduce_s": ar,
    }


def preflight(
    dump: str | None = None,
    *,
    size: int = 1024,
    numel: int = 1 << 20,
    repeats: int = 5,
    ratio: float = 1.5,
) -> list[int]:
    """Measure on every rank, print the table and the flagged ranks on rank 0; every rank
    returns the flagged ranks."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, measure(size, numel, repeats))
    median = statistics.median(r["matmul_s"] for r in rows)
    flagged = [r["rank"] for r in rows if r["matmul_s"] > ratio * median]
    if dist.get_rank() == 0:
        print(f"preflight: {len(rows)} ranks, {size}x{size} matmul, all-reduce of {numel} floats")
        print(
            f"{'rank':>4} {'host':<20} {'device':<8} {'matmul ms':>10} {'TFLOP/s':>8} "
            f"{'all-reduce ms':>14}"
        )
        for r in rows:
            mark = "  <- slow" if r["rank"] in flagged else ""
            print(
                f"{r['rank']:>4} {r['host']:<20} {r['device']:<8} {r['matmul_s'] * 1e3:>10.3f} "
                f"{r['matmul_tflops']:>8.3f} {r['all_reduce_s'] * 1e3:>14.3f}{mark}"
            )
        for k in flagged:
            row = rows[k]
            print(
                f"preflight: rank {k} on {row['host']}: matmul {row['matmul_s'] / median:.2f}x "
                f"the median rank's ({ratio:g}x flags)"
            )
        hosts = sorted({rows[k]["host"] for k in flagged})
        print(f"exclude: {','.join(hosts)}" if hosts else "preflight: no rank flagged")
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, "preflight.json"), "w") as f:
                json.dump({"ratio": ratio, "flagged": flagged, "ranks": rows}, f, indent=1)
    return flagged


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(dump: str | None, ratio: float) -> int:
    """Under torchrun: initialise the process group, run the pre-flight, return 1 when a rank
    was flagged, else 0."""
    if "RANK" not in os.environ:  # one process, no launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device = seam.pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(seam.backend_for(device))
    try:
        return 1 if preflight(dump, ratio=ratio) else 0
    finally:
        dist.destroy_process_group()
