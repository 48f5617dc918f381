"""Where one decode step of the paged generator goes, against its weight-read floor.

A random model of a given shape (Qwen3-1.7B, Qwen3-8B, or a tiny one for the
CPU) takes ``--batch`` prompts; after their prefills and ``--warmup`` decode
steps, ``--steps`` pure decode steps are timed (wall clock per step, device
synchronised) and profiled with torch.profiler. It prints:

- the step time against the floor: the bytes every decode step must read (the
  weights once, plus each sequence's KV) over ``--bandwidth-gbs``;
- the device time per step by kernel class (matmul, attention, norm, rope,
  sampling, elementwise, copy, other) with kernel counts and shares of the
  device total, so a CUDA graph's contents are visible by class;
- the host time per step outside the device's busy time (scheduling, sampling
  bookkeeping): wall minus device time.

Run from the repository root::

    python -m bench.decode_profile --shape tiny                      # CPU, seconds
    python -m bench.decode_profile --shape qwen3-1.7b --batch 64 --device cuda --dtype bfloat16 \\
        --cuda-graphs
    python -m bench.decode_profile --shape qwen3-8b --batch 256 --device cuda --dtype bfloat16 \\
        --cuda-graphs

On the CPU the "device" is the CPU itself, so the classes are of CPU operators and
the host column is what remains outside them.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.header import print_header
from tandem import device as seam
from tandem.models.args import ModelArgs
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import inference_layout
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams

SHAPES = {
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
# kernel / operator name fragments -> class (first match wins)
CLASSES = (
    ("attention", ("attention", "attn", "paged", "sdpa", "flash")),
    (
        "sampling",
        (
            "sort",
            "topk",
            "softmax",
            "multinomial",
            "argmax",
            "exponential",
            "noise",
            "cumsum",
            "gather",
        ),
    ),
    ("norm", ("norm", "rsqrt")),
    ("rope", ("rope", "rotary")),
    (
        "matmul",
        ("gemm", "matmul", "mm", "linear", "cublas", "cutlass", "sm90_xmma", "addmm", "onednn"),
    ),
    ("copy", ("copy", "memcpy", "memset", "cat", "index_put", "scatter", "fill")),
    (
        "elementwise",
        ("elementwise", "mul", "add", "silu", "sigmoid", "exp", "neg", "where", "pow", "div"),
    ),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, parts in CLASSES:
        if any(p in low for p in parts):
            return cls
    return "other"


def build(args: argparse.Namespace) -> Transformer:
    margs = ModelArgs(
        model_type="qwen3", rope_theta=1e6, max_position_embeddings=8192, **SHAPES[args.shape]
    )
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with torch.device(device):
        model = Transformer(margs)
    model.init_weights(0)
    model = model.to(dtype).eval().requires_grad_(False)
    inference_layout(model)
    return model


def _sync(device: torch.device) -> None:
    seam.synchronize(device)


def floor_bytes(
    model: Transformer, batch: int, context: int, dtype: torch.dtype
) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step must read: every weight once, every
    sequence's K/V."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    a = model.args
    kv = (
        2
        * a.num_layers
        * a.num_kv_heads
        * a.head_dim
        * torch.empty((), dtype=dtype).element_size()
        * batch
        * context
    )
    return float(weights), float(kv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default=seam.accelerator_type())
    ap.add_argument(
        "--dtype", default="bfloat16" if seam.accelerator_type() != "cpu" else "float32"
    )
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument(
        "--kv-cache-gb", type=float, default=None, help="default: enough for every sequence"
    )
    ap.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=4800.0,
        help="memory bandwidth of the floor (H200: 4800)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shape, batch 4, 2 steps (the test suite's run)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.batch, args.prompt, args.warmup, args.steps = "tiny", 4, 16, 1, 2
    print_header("bench.decode_profile", argv, args.device)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(args)
    a = model.args
    per_token_kv = (
        2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.empty((), dtype=dtype).element_size()
    )
    total_tokens = args.batch * (args.prompt + args.warmup + args.steps + 32)
    kv_gb = args.kv_cache_gb or max(per_token_kv * total_tokens * 1.25 / 2**30, 0.01)
    settings = GenerationSettings(
        block_size=16,
        kv_cache_gb=kv_gb,
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(args.prompt * args.batch, 2048),
        seed=0,
        cuda_graphs=args.cuda_graphs,
    )
    gen = Generator(model, settings)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=1.0, max_tokens=args.warmup + args.steps + 16, ignore_eos=True, seed=1
    )
    for _ in range(args.batch):
        gen.add(torch.randint(4, a.vocab_size, (args.prompt,), generator=g).tolist(), params)
    while gen.scheduler.waiting or any(s.num_generated == 0 for s in gen.scheduler.running):
        gen.step()  # prefills (and the first token of each sequence)
    for _ in range(args.warmup):
        gen.step()
    _sync(device)
    walls = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            gen.step()
            _sync(device)
            walls.append(time.perf_counter() - t0)
    gen.close()
    per_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    use_cuda = device.type == "cuda"
    for ev in prof.key_averages():
        t = (ev.device_time_total if use_cuda else ev.self_cpu_time_total) / 1e3  # ms
        if t <= 0 or (not use_cuda and not ev.key.startswith("aten::")):
            continue
        cls = classify(ev.key)
        per_class[cls][0] += t
        per_class[cls][1] += ev.count
    step_ms = 1e3 * sorted(walls)[len(walls) // 2]
    device_ms = sum(v[0] for v in per_class.values()) / args.steps
    w_bytes, kv_bytes = floor_bytes(
        model, args.batch, args.prompt + args.warmup + args.steps // 2, dtype
    )
    floor_ms = 1e3 * (w_bytes + kv_bytes) / (args.bandwidth_gbs * 1e9)
    print(
        f"decode step, {args.shape}, batch {args.batch}, context "
        f"~{args.prompt + args.warmup + args.steps // 2}, {args.dtype} on {device.type}"
        f"{' with CUDA graphs' if args.cuda_graphs else ''}"
    )
    print(f"{'':14}{'ms/step':>10}{'tandem/kernels/step':>14}{'share':>8}")
    for cls, (ms, n) in sorted(per_class.items(), key=lambda kv: -kv[1][0]):
        print(
            f"{cls:14}{ms / args.steps:>10.3f}{n / args.steps:>14.1f}"
            f"{ms / args.steps / max(device_ms, 1e-9):>8.1%}"
        )
    print(f"{'device total':14}{device_ms:>10.3f}")
    if use_cuda:
        print(
            f"{'host / gaps':14}{max(step_ms - device_ms, 0.0):>10.3f}   (wall minus device time)"
        )
    else:
        # operator self-times under the profiler include its per-op overhead: shares, not a wall
        # split
        print(
            "(CPU: operator self-times under the profiler, which adds per-operator overhead; "
            "read the shares)"
        )
    print(f"{'wall (median)':14}{step_ms:>10.3f}")
    print(
        f"floor: {w_bytes / 1e9:.2f} GB weights + {kv_bytes / 1e9:.3f} GB KV at "
        f"{args.bandwidth_gbs:.0f} GB/s = {floor_ms:.3f} ms; step / floor = "
        f"{step_ms / max(floor_ms, 1e-9):.1f}x"
    )


if __name__ == "__main__":
    main()
