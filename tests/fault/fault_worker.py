"""Scenarios for tests/fault/test_fault.py, run as a plain process or under torchrun (gloo, CPU).

python tests/fault/fault_worker.py hang --dump D
    world of one; the watchdog fires while the step sleeps in a fake collective.
torchrun --standalone --nproc-per-node 2 tests/fault/fault_worker.py hang-dist --dump D
    rank 1 stalls before an all_reduce that rank 0 is already waiting in;
    both ranks' watchdogs dump (the gloo timeout is far longer than theirs).
torchrun ... tests/fault/fault_worker.py preempt --dump D
    a step loop that asks `should_stop_all` every step; each rank writes its
    pid to D/pid-<r> and, when it stops, the step to D/stopped-<r>, then exits 75.
torchrun ... tests/fault/fault_worker.py nan --dump D
    rank 1 injects a NaN gradient; both ranks must skip, then both must stop.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tandem.rl.fault import (  # noqa: E402
    EXIT_NONFINITE,
    NonFiniteError,
    PreemptionHandler,
    Watchdog,
    check_finite,
)

WATCHDOG_S = 1.5
GLOO_TIMEOUT_S = 120  # must exceed WATCHDOG_S by far: the watchdog, not gloo, must end the hang
EXIT_PREEMPTED = 75


def fake_collective_that_never_returns() -> None:
    time.sleep(300)


def stuck_before_all_reduce() -> None:
    time.sleep(300)


def _init() -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


def hang(dump: str) -> int:
    wd = Watchdog(dump, WATCHDOG_S, rank=0, poll_s=0.1).start()
    for step in range(3):
        wd.beat(step)
    with wd.phase("update"):
        fake_collective_that_never_returns()
    return 0


def hang_dist(dump: str) -> int:
    rank, _ = _init()
    wd = Watchdog(dump, WATCHDOG_S, rank=rank, poll_s=0.1).start()
    x = torch.ones(1)
    for step in range(3):
        with wd.phase("rollout"):
            dist.all_reduce(x)
        wd.beat(step)
    wd.phase("update")
    if rank == 1:
        stuck_before_all_reduce()
    dist.all_reduce(x)  # rank 0 waits here for rank 1
    return 0


def preempt(dump: str) -> int:
    rank, _ = _init()
    handler = PreemptionHandler(dump, rank).install()
    with open(os.path.join(dump, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    x = torch.ones(1)
    for step in range(2000):
        dist.all_reduce(x)
        time.sleep(0.01 * (1 + rank))  # ranks drift apart: the signal lands at different steps
        if handler.should_stop_all(step=step):
            with open(os.path.join(dump, f"stopped-{rank}"), "w") as f:
                f.write(str(step))
            handler.uninstall()
            return EXIT_PREEMPTED
    return 1


def nan(dump: str) -> int:
    rank, _ = _init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    assert check_finite(loss, model, 0, rank, "skip")
    if rank == 1:
        model[1].weight.grad[0, 2] = float("nan")
    ok = check_finite(loss, model, 1, rank, "skip")
    with open(os.path.join(dump, f"skip-{rank}"), "w") as f:
        f.write(str(ok))
    try:
        check_finite(loss, model, 2, rank, "stop", dump_folder=dump)
    except NonFiniteError as e:
        print(f"rank {rank}: {e}", flush=True)
        return EXIT_NONFINITE
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["hang", "hang-dist", "preempt", "nan"])
    p.add_argument("--dump", required=True)
    a = p.parse_args()
    os.makedirs(a.dump, exist_ok=True)
    fn = {"hang": hang, "hang-dist": hang_dist, "preempt": preempt, "nan": nan}[a.scenario]
    status = fn(a.dump)
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
