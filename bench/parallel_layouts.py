"""Time one update step (forward, backward, AdamW) on each parallel layout.

    python bench/parallel_layouts.py                 # CPU, tiny model, 2- and 4-rank layouts
    python bench/parallel_layouts.py --size small    # a ~30M qwen3, B=8, S=512
    python bench/parallel_layouts.py --device auto --size small --nproc 4   # on GPUs

Launches tests/parallel/parallel_worker.py under torchrun once per world size (the same
layouts the equivalence test checks) and prints a table: median step time after
a warm-up step, tokens/s per rank, and on an accelerator MFU from
``ModelArgs.flops_per_token`` against ``--peak-tflops`` (per device; the worker
trains in fp32, so compare against the fp32/TF32 peak you care about). Layouts
use the tiny test families except qwen3, which ``--size small`` enlarges.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "parallel"))

import parallel_worker as pw  # noqa: E402

LAYOUTS = {
    2: [
        "fsdp2",
        "fsdp2_ac_full",
        "tp2",
        "tp2_ac_selective",
        "pp2_1f1b",
        "pp2_gpipe",
        "pp2_interleaved",
    ],
    4: ["fsdp2_tp2", "pp2_fsdp2", "hsdp2x2", "pp2_tp2"],
}


def run(nproc: int, layouts: list[str], opts: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.pt"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(ROOT / "tests" / "parallel" / "parallel_worker.py"),
            "--out",
            str(out),
            "--layouts",
            ",".join(layouts),
            "--steps",
            str(opts.steps),
            "--device",
            opts.device,
            "--size",
            opts.size,
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        return torch.load(out, weights_only=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, choices=(2, 4), nargs="*", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu", choices=("cpu", "auto"))
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak for MFU")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="fsdp2 and tp2 on 2 ranks, 2 steps (the test suite's run)",
    )
    opts = parser.parse_args()
    if opts.smoke:
        opts.nproc, opts.steps = [2], 2
        LAYOUTS[2] = ["fsdp2", "tp2"]
    from bench.header import print_header

    print_header("bench.parallel_layouts", device="cuda" if opts.device == "auto" else "cpu")
    if opts.size == "small":
        pw._use_small_model()
    rows = []
    for nproc in opts.nproc:
        res = run(nproc, LAYOUTS[nproc], opts)
        for name, failure in res["failures"].items():
            print(f"{name}: FAILED\n{failure}", file=sys.stderr)
        for name, r in res["layouts"].items():
            layout = pw.LAYOUTS[name]
            args = pw.FAMILIES[layout.family]
            tokens = res["batch"] * res["seq"]  # global tokens per step
            tps = tokens / r["time_s"] / nproc
            mfu = None
            if res["device"] != "cpu":
                mfu = args.flops_per_token(res["seq"]) * tps / (opts.peak_tflops * 1e12)
            rows.append((name, nproc, layout.family, r["time_s"] * 1e3, tps, mfu, res["device"]))
    first = {}  # the reference of each world size: its first layout (fsdp2, fsdp2_tp2)
    for name, n, _, ms, *_ in rows:
        first.setdefault(n, (name, ms))
    print("ratio: the step time of the first layout of the same world size / this layout's")
    print(
        f"{'layout':20s} {'ranks':>5s} {'family':>10s} {'step ms':>9s} {'tok/s/rank':>11s} "
        f"{'MFU':>7s} {'ratio':>16s}  device"
    )
    for name, n, fam, ms, tps, mfu, dev in rows:
        mfu_s = f"{100 * mfu:6.2f}%" if mfu is not None else "     -"
        ref, ref_ms = first[n]
        ratio = f"{ref_ms / ms:.2f}x vs {ref}"
        print(f"{name:20s} {n:5d} {fam:>10s} {ms:9.1f} {tps:11.0f} {mfu_s:>7s} {ratio:>16s}  {dev}")


if __name__ == "__main__":
    main()
