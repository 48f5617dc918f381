"""What the rank doctor costs per step: the health gathering, and a replica check.

    python -m bench.health                 # 2 CPU ranks (gloo), 300 rounds, a 4-step quickstart
    python -m bench.health --rounds 1000 --steps 0   # no quickstart run (no ratio)
    python -m bench.health --smoke          # 20 rounds, a 2-step quickstart (the test suite's run)

The health gathering's cost is measured as the difference between two loops on ``--nproc``
ranks (torchrun, gloo), each round one step's worth of the shell's work around the ledger:

    ledger   all_gather_object of the step's ids and positions (what the shell did before)
    health   the same gather carrying every rank's health row, after four phase switches
             and one ``waiting`` block (what a step does), then `summarize`, the straggler
             watch and rank 0's append to health.jsonl

Per-round medians; the overhead is health minus ledger. The replica check's per-rank part
(`local_sums`, the exact checksum of every local parameter shard) is timed on the quickstart
policy's weights. The ratio is the overhead over the quickstart's own step time
(``time/step_s`` of a ``--steps`` quickstart run on the same ranks, median of the steps after
the first). Prints a table and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")


def _worker(rounds: int, out: str) -> None:
    import torch.distributed as dist

    from tandem.rl.core import health

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [f"addition_small/train/0/{rank * 100 + i}" for i in range(16)]
    positions = list(range(rank * 16, rank * 16 + 16))
    clock = health.PhaseClock()
    health.install(clock)
    watch = health.StragglerWatch(1.5, 3)
    log = os.path.join(out, "health.jsonl")

    def ledger() -> None:
        every: list = [None] * world
        dist.all_gather_object(every, (sorted(set(ids)), sorted(set(positions))))

    def with_health(step: int) -> None:
        for phase in ("step", "rollout", "update", "step"):
            clock.switch(phase)
        with health.waiting("all_reduce:nonfinite_flag"):
            pass
        every: list = [None] * world
        mine = {"rank": rank, "host": "h", **clock.take()}
        with health.waiting("all_gather:ledger_and_health"):
            dist.all_gather_object(every, (sorted(set(ids)), sorted(set(positions)), mine))
        rows = [h for _, _, h in every]
        summary = health.summarize(rows)
        watch.observe(step, summary, [r["host"] for r in rows])
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **summary, "ranks": rows}))
                f.write("\n")

    times: dict[str, list[float]] = {"ledger": [], "health": []}
    for i in range(rounds):  # interleaved, so load changes hit both alike
        for name in ("ledger", "health"):
            dist.barrier()
            t0 = time.perf_counter()
            ledger() if name == "ledger" else with_health(i)
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _replica_sums_s(repeat: int = 5) -> tuple[float, int]:
    """Seconds of `local_sums` over the quickstart policy's parameters (median), and their
    element count."""
    from safetensors.torch import load_file

    from tandem.rl.fault.replica import local_sums

    params = []
    for name in sorted(os.listdir(POLICY)):
        if name.endswith(".safetensors"):
            params += sorted(load_file(os.path.join(POLICY, name)).items())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        local_sums(params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(p.numel() for _, p in params)


def _quickstart_step_s(nproc: int, steps: int, dump: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--training.eval_interval=0",
        "--rl.eval_prompts=8",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf_at_end=false",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    return statistics.median(r["time/step_s"] for r in rows[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--steps", type=int, default=4, help="quickstart steps for the ratio; 0: none")
    p.add_argument("--smoke", action="store_true", help="20 rounds, 2 quickstart steps (tests)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.steps = 20, 2
    if a.worker:
        _worker(a.rounds, a.worker)
        return
    from bench.header import print_header

    print_header("bench.health")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={a.nproc}",
            "-m",
            "bench.health",
            "--rounds",
            str(a.rounds),
            "--worker",
            tmp,
        ]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
        times = json.load(open(os.path.join(tmp, "times.json")))
        step_s = _quickstart_step_s(a.nproc, a.steps, os.path.join(tmp, "qs")) if a.steps else None
    ledger = statistics.median(times["ledger"]) * 1e3
    with_health = statistics.median(times["health"]) * 1e3
    sums_s, numel = _replica_sums_s()
    print(f"{a.nproc} ranks (gloo, CPU), {a.rounds} rounds, per-round medians")
    print(f"{'what':<44} {'ms':>9}")
    print(f"{'ledger gather alone (before)':<44} {ledger:>9.3f}")
    print(f"{'ledger gather + health (now)':<44} {with_health:>9.3f}")
    print(f"{'health overhead per step':<44} {with_health - ledger:>9.3f}")
    print(f"{f'replica check, local checksums ({numel} el.)':<44} {sums_s * 1e3:>9.3f}")
    if step_s is not None:
        print(f"{'quickstart step (time/step_s, median)':<44} {step_s * 1e3:>9.1f}")
        ratio = (with_health - ledger) / 1e3 / step_s
        print(f"ratio: health overhead / quickstart step = {ratio:.4f}")


if __name__ == "__main__":
    main()
