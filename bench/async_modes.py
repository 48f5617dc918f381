"""Synchronous vs colocated asynchronous vs split RL on a long-tail workload, one command.

    python -m bench.async_modes                      # 2 CPU ranks, 8 steps, S = 1 and 2
    python -m bench.async_modes --steps 12 --staleness 1 2 4
    python -m bench.async_modes --smoke              # 3 steps, S = 1, 12 tokens (the test's size)
    python -m bench.async_modes --workload agentic   # the agentic quickstart with slow tools

The quickstart (16 prompts x 8 samples a step) with every prompt group's completion length
drawn from a Pareto(1.2) above 2 tokens, capped at ``--max-tokens`` (TANDEM_INJECT_LENGTHS,
EOS ignored: a few groups run to the cap, most stop early), and a generator slowed by
``--delay`` seconds per decode step (TANDEM_INJECT_GEN_DELAY): the last rank's in sync and
colocated_async, which run on ``--nproc`` ranks that all generate and train; in split, on
the same number of ranks, rank 0's, the one generator (the others train). Each mode trains the same
prompts; the table gives the mean step time (steps 2 on: the first builds the generation
copy), steps per minute, the share of a step the generators have nothing to decode (sync and
colocated: the update; split: waiting for the weights) and the trainers wait (sync and
colocated: the rollout; split: waiting for samples), the generator's idle batch slots
(``async/gen_idle_frac``), the mean and max staleness of the trained samples, and each mode's
step time over the synchronous one's (< 1: faster).

``--workload agentic``: configs/quickstart_agentic.toml (8 prompts x 8 episodes a step, the
python tool in the code sandbox, up to 3 turns) with every environment step held by a time
drawn from a Pareto(1.2) above ``--tool-delay`` seconds, capped at 25 times it
(TANDEM_INJECT_TOOL_DELAY), and ``--tool-workers`` environment workers a rank (enough that the
tools' capacity is not the limit): the agentic long tail, where a few tool calls take far longer
than the rest; no length drill and no slowed generator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(
    dump: str,
    steps: int,
    nproc: int,
    max_tokens: int,
    delay: float,
    extra: list[str],
    tool_delay: float = 0.0,
    tool_workers: int = 16,
) -> list[dict[str, float]]:
    """One mode's run: the long-tail workload, or with ``tool_delay`` the agentic one."""
    slow = 0 if "--rollout.mode=split" in extra else nproc - 1  # a generator's rank
    if tool_delay:
        config, size = "quickstart_agentic.toml", [f"--env.num_workers={tool_workers}"]
        drills = {"TANDEM_INJECT_TOOL_DELAY": f"1.2:{tool_delay}:{25 * tool_delay}"}
    else:
        config, size = "quickstart.toml", ["--rl.prompts_per_step=16"]
        size.append(f"--rollout.max_tokens={max_tokens}")
        drills = {
            "TANDEM_INJECT_LENGTHS": f"1.2:2:{max_tokens}",
            "TANDEM_INJECT_GEN_DELAY": f"{slow}:{delay}",
        }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", config),
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        *size,
        "--rl.eval_prompts=8",
        "--training.eval_interval=0",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        "--checkpoint.interval=1000",
        "--checkpoint.export_hf_at_end=false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **drills}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    later = [r for r in rows if r["step"] > 1]
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in later)  # noqa: E731
    split = "split/train_wait_s" in later[0]
    step = mean("time/step_s")
    return {
        "step_s": step,
        "gen_wait": mean("split/gen_wait_s" if split else "time/update_s") / step,
        "train_wait": mean("split/train_wait_s" if split else "time/rollout_s") / step,
        "idle": mean("async/gen_idle_frac") if "async/gen_idle_frac" in later[0] else None,
        "stale_mean": mean("async/staleness_mean"),
        "stale_max": max(r.get("async/staleness_max", 0.0) for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--delay", type=float, default=0.003)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--smoke", action="store_true", help="3 steps, S = 1, 12 tokens, no delay")
    ap.add_argument("--workload", choices=["long_tail", "agentic"], default="long_tail")
    ap.add_argument(
        "--tool-delay", type=float, default=0.05, help="agentic: the Pareto's floor (s)"
    )
    ap.add_argument(
        "--tool-workers", type=int, default=16, help="agentic: environment workers per rank"
    )
    args = ap.parse_args()
    tool_delay = args.tool_delay if args.workload == "agentic" else 0.0
    if args.smoke:
        args.steps, args.staleness, args.max_tokens, args.delay = 3, [1], 12, 0.0
    from bench.header import print_header

    print_header("bench.async_modes")
    modes = [("sync", [])]
    modes += [
        (
            f"colocated_async S={s}",
            ["--rollout.mode=colocated_async", f"--rollout.max_staleness={s}"],
        )
        for s in [0, *args.staleness]
        if s or tool_delay
    ]
    modes += [
        (
            f"split S={s}",
            ["--rollout.mode=split", "--rollout.gen_ranks=1", f"--rollout.max_staleness={s}"],
        )
        for s in [0, *args.staleness]
    ]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(modes):
            out[name] = summary(
                launch(
                    os.path.join(tmp, str(i)),
                    args.steps,
                    args.nproc,
                    args.max_tokens,
                    args.delay,
                    extra,
                    tool_delay,
                    args.tool_workers,
                )
            )
    ref = out["sync"]["step_s"]
    if tool_delay:
        print(
            f"{args.nproc} ranks, {args.steps} steps, configs/quickstart_agentic.toml (8 prompts "
            f"x 8 episodes), every tool call held Pareto(1.2) in [{tool_delay}, "
            f"{25 * tool_delay}] s, {args.tool_workers} environment workers a rank"
        )
    else:
        print(
            f"{args.nproc} ranks, {args.steps} steps, 16 prompts x 8 samples, lengths "
            f"Pareto(1.2) in [2, {args.max_tokens}], one generator +{args.delay}s per decode step"
        )
    print(
        f"{'mode':<22} {'step s':>7} {'steps/min':>9} {'gen wait':>8} {'train wait':>10} "
        f"{'idle slots':>10} {'stale mean':>10} {'stale max':>9} {'vs sync':>7}"
    )
    for name, s in out.items():
        idle = "-" if s["idle"] is None else f"{s['idle']:.2f}"
        print(
            f"{name:<22} {s['step_s']:>7.2f} {60 / s['step_s']:>9.1f} {s['gen_wait']:>8.2f} "
            f"{s['train_wait']:>10.2f} {idle:>10} {s['stale_mean']:>10.2f} "
            f"{s['stale_max']:>9.0f} {s['step_s'] / ref:>7.2f}"
        )


if __name__ == "__main__":
    main()
