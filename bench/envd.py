"""The cost of the hop to tandem-envd: the agentic quickstart with local environment and reward
workers against the same run with its environments on two tandem-envd processes (loopback).

    python -m bench.envd                  # 4 steps, 1 CPU rank
    python -m bench.envd --smoke          # 1 step (the test suite's run)

Both runs train the same prompts with the same seed; the table gives the mean step time (steps
2 on: the first builds the generation copy and warms the workers), the environment time the
devices waited for (``env/device_wait_s``), and the envd run's step time over the local one's.
The last line says whether both runs sampled the same episodes (every step's reward, length,
turns and tool calls equal): the hop must change nothing but the time; it exits 1 if not.
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
SAME = ("reward/total", "response/length_mean", "env/turns_mean", "env/tool_calls_per_episode")
TOKEN = "bench-envd-token"


def train(dump: str, steps: int, extra: list[str]) -> list[dict[str, float]]:
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart_agentic.toml"),
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf_at_end=false",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "TANDEM_ENVD_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"train.py failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def start_envd() -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": ROOT, "TANDEM_ENVD_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "tandem.rl.workers.envd", "--port", "0", "--workers", "2"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("tandem-envd listening on "):
        sys.exit(f"tandem-envd did not start: {line!r}")
    return proc, line.split()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="1 step (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 1
    from bench.header import print_header

    print_header("bench.envd", None)
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs["local workers"] = train(os.path.join(tmp, "local"), args.steps, [])
        servers = [start_envd() for _ in range(2)]
        try:
            workers = ",".join(address for _, address in servers)
            runs["two tandem-envd"] = train(
                os.path.join(tmp, "envd"),
                args.steps,
                [f"--env.workers={workers}"],
            )
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"agentic quickstart, {args.steps} steps, 1 CPU rank (mean of steps 2 on)")
    print(f"{'workers':<18}{'step s':>9}{'env wait s':>12}")
    times = {}
    for name, rows in runs.items():
        later = rows[1:] or rows
        times[name] = statistics.mean(r["time/step_s"] for r in later)
        wait = statistics.mean(r.get("env/device_wait_s", 0.0) for r in later)
        print(f"{name:<18}{times[name]:>9.2f}{wait:>12.2f}")
    print(f"envd / local step time: {times['two tandem-envd'] / times['local workers']:.2f}x")
    same = all(
        a.get(k) == b.get(k)
        for a, b in zip(runs["local workers"], runs["two tandem-envd"], strict=True)
        for k in SAME
    )
    print(f"same episodes and rewards every step: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
