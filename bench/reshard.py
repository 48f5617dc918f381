"""Move the policy into the generation layout: seconds and bytes per rank, per layout.

    python bench/reshard.py                       # the quickstart model, CPU, 2 and 4 ranks
    python bench/reshard.py --size 0.6b           # Qwen3-0.6B shapes (seeded weights)
    python bench/reshard.py --device cuda --size 1.7b --nproc 1   # on a GPU

Launches itself under torchrun per world size. For each training layout and
generation degree it builds the policy (tandem/rl/update/policy.py, seeded init), then
times `GenerationCopy.build` (the bucketed reshard, tandem/parallel/reshard.py; the
plan is made at the first build and kept, so the median of the later builds is
reported) and, as the reference in the same run, the path it replaced: every
rank gathering the whole state dict (`policy.full_state()`) and casting it.
Prints seconds, MB sent per rank, the shard each rank ends up with, and the
ratio reference / reshard.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem import device as seam

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # name -> ModelArgs kwargs (the quickstart's HF folder, Qwen3-0.6B / 1.7B shapes)
    "quickstart": None,
    "0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "1.7b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}
LAYOUTS = {
    1: [("single", {}, [1])],
    2: [("fsdp2", {"dp_shard": 2}, [1, 2]), ("tp2", {"tp": 2}, [1, 2]), ("pp2", {"pp": 2}, [1, 2])],
    4: [("fsdp2_tp2", {"dp_shard": 2, "tp": 2}, [1, 2, 4])],
}


def _args(size: str):
    from tandem.models.args import ModelArgs
    from tandem.models.hf import load_args

    kw = SIZES[size]
    return load_args(ROOT / "assets" / "quickstart-policy") if kw is None else ModelArgs(**kw)


def worker(opts: argparse.Namespace) -> None:
    import torch.distributed as dist

    from tandem.parallel.distributed import init_distributed
    from tandem.parallel.generation_layout import GenerationCopy, check_divisible, make_layout
    from tandem.parallel.mesh import Degrees, build_mesh
    from tandem.rl.core.modeling import BuildSpec
    from tandem.rl.update.policy import build_policy

    info = init_distributed(force_cpu=opts.device == "cpu")
    dev, args = info.device, _args(opts.size)
    dtype = getattr(torch, opts.dtype)
    rows = []
    for name, degrees, gens in LAYOUTS[info.world_size]:
        mesh = build_mesh(Degrees(**degrees), dev)
        policy = build_policy(
            args,
            mesh,
            dev,
            pp_schedule="1F1B",
            pp_microbatches=0,
            seq_len=64,
            micro_batch_tokens=64,
            chunk_tokens=64,
            path=None,
            seed=0,
            spec=BuildSpec(),
            is_main=info.is_main,
        )
        for g in gens:
            if check_divisible(args, g):
                continue
            copy = GenerationCopy(
                policy.state_module,
                args,
                make_layout(g),
                dev,
                dtype,
                bucket_bytes=opts.bucket_mb << 20,
            )
            times, metrics = [], {}
            for _ in range(opts.repeat + 1):  # the first build also makes the plan
                _sync(dev)
                t0 = time.perf_counter()
                model, metrics = copy.build()
                _sync(dev)
                times.append(time.perf_counter() - t0)
                del model
            ref = []
            for _ in range(opts.repeat):
                _sync(dev)
                t0 = time.perf_counter()
                full = {k: v.to(dtype) for k, v in policy.full_state().items()}
                _sync(dev)
                ref.append(time.perf_counter() - t0)
                ref_bytes = sum(v.numel() * v.element_size() for v in full.values())
                del full
            rows.append(
                (
                    name,
                    g,
                    statistics.median(times[1:]),
                    times[0],
                    metrics["reshard/sent_gb"] * 1e3,
                    metrics["reshard/gb"] * 1e3,
                    statistics.median(ref),
                    ref_bytes / 1e6,
                )
            )
        del policy
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, rows)
    if info.is_main:
        torch.save(gathered, opts.out)
    dist.destroy_process_group()


def _sync(dev: torch.device) -> None:
    seam.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="quickstart", choices=sorted(SIZES))
    ap.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the quickstart model on one rank (the test suite's run)",
    )
    opts = ap.parse_args()
    if opts.worker:
        return worker(opts)
    if opts.smoke:
        opts.size, opts.nproc, opts.repeat = "quickstart", [1], 1
    from bench.header import print_header

    print_header("bench.reshard", device=opts.device)
    print(
        f"model {opts.size}, generation dtype {opts.dtype}, bucket {opts.bucket_mb} MB, device "
        f"{opts.device}"
    )
    print(
        f"{'ranks':>5} {'training':>10} {'gen tp':>6} {'reshard s':>10} {'first s':>8} "
        f"{'sent MB/rank':>12} {'shard MB':>9} {'gather s':>9} {'gather MB':>9} "
        f"{'gather/reshard':>14}"
    )
    for n in opts.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.pt")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                __file__,
                "--worker",
                "--out",
                out,
                "--size",
                opts.size,
                "--device",
                opts.device,
                "--dtype",
                opts.dtype,
                "--bucket-mb",
                str(opts.bucket_mb),
                "--repeat",
                str(opts.repeat),
            ]
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
            per_rank = torch.load(out, weights_only=False)
        for i, row in enumerate(per_rank[0]):
            name, g, t, first, _, shard, ref_t, ref_mb = row
            sent = max(r[i][4] for r in per_rank)  # the busiest rank
            print(
                f"{n:>5} {name:>10} {g:>6} {t:>10.3f} {first:>8.3f} {sent:>12.1f} {shard:>9.1f} "
                f"{ref_t:>9.3f} {ref_mb:>9.1f} {ref_t / t:>14.2f}"
            )


if __name__ == "__main__":
    main()
