"""Benchmark the paged-KV kernels: PyTorch reference vs Triton, on whatever device exists.

Run from the repository root::

    python -m bench.paged_attention                  # CUDA: realistic sizes, bf16
    python -m bench.paged_attention --preset small   # tiny sizes (CPU)
    TRITON_INTERPRET=1 python -m bench.paged_attention --preset small   # CPU, both impls

Prints one row per case (store_kv, prefill, extend, decode, split-K decode): the
median time of each implementation, the speedup of Triton over the reference, and
for decode the KV bytes read per second. On CPU without ``TRITON_INTERPRET`` only
the reference is timed (the interpreter times say nothing about GPU speed; they
only show the script works). Record measurements in docs/, not in code.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem import device as seam
from tandem.kernels import paged_attention as pa
from tandem.kernels.dispatch import triton_available, triton_interpreting


@dataclass
class Case:
    name: str
    num_seqs: int
    context_len: int
    q_len: int
    num_splits: int | None = None  # decode only; None = heuristic


PRESETS: dict[str, list[Case]] = {
    "full": [
        Case("store_kv", 64, 1, 1),
        Case("prefill", 4, 2048, 2048),
        Case("extend", 8, 2048, 256),
        Case("decode", 64, 1024, 1),
        Case("decode", 256, 512, 1),
        Case("decode long", 4, 16384, 1),
        Case("decode long", 4, 16384, 1, num_splits=1),
    ],
    "small": [
        Case("store_kv", 4, 1, 1),
        Case("prefill", 2, 40, 40),
        Case("extend", 2, 48, 8),
        Case("decode", 4, 64, 1),
        Case("decode split", 2, 200, 1, num_splits=3),
    ],
}


@dataclass
class Inputs:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys (store_kv)
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor  # [N, MB]
    cu_seqlens_q: torch.Tensor  # [N + 1]
    context_lens: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [T]


def make_inputs(
    case: Case, *, hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype, device: str
) -> Inputs:
    """Random caches and shuffled block tables; every sequence has the same lengths."""
    n, ctx, q_len = case.num_seqs, case.context_len, case.q_len
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = n * blocks_per_seq
    perm = torch.randperm(num_blocks, device=device).int()
    tables = perm.view(n, blocks_per_seq)  # [N, MB]
    cache = (num_blocks, block_size, hkv, d)
    positions = torch.arange(ctx - q_len, ctx, device=device)  # [L]
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # [N, L]
    t = n * q_len
    return Inputs(
        q=torch.randn(t, hq, d, dtype=dtype, device=device),
        k=torch.randn(t, hkv, d, dtype=dtype, device=device),
        k_cache=torch.randn(cache, dtype=dtype, device=device),
        v_cache=torch.randn(cache, dtype=dtype, device=device),
        block_tables=tables,
        cu_seqlens_q=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device),
        context_lens=torch.full((n,), ctx, dtype=torch.int32, device=device),
        slot_mapping=slots.flatten().long(),
    )


def time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        seam.synchronize(device)
        start = time.perf_counter()
        fn()
        seam.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def case_fn(case: Case, x: Inputs, impl: str, scale: float) -> Callable[[], object]:
    if case.name == "store_kv":
        return lambda: pa.store_kv(x.k, x.k, x.k_cache, x.v_cache, x.slot_mapping, impl=impl)
    if case.q_len == 1:
        return lambda: pa.paged_decode_attention(
            x.q,
            x.k_cache,
            x.v_cache,
            x.block_tables,
            x.context_lens,
            scale,
            impl=impl,
            num_splits=case.num_splits,
        )
    return lambda: pa.paged_attention(
        x.q,
        x.k_cache,
        x.v_cache,
        x.block_tables,
        x.cu_seqlens_q,
        x.context_lens,
        scale,
        impl=impl,
        max_q_len=case.q_len,
    )


def main(argv: list[str] | None = None) -> None:
    from tandem.rl.core.system import tune_host_allocator

    # as train.py does: otherwise CPU timings depend on glibc's mmap threshold
    tune_host_allocator()
    device = seam.accelerator_type()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="full" if device == "cuda" else "small"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16" if device == "cuda" else "float32",
    )
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20 if device == "cuda" else 3)
    parser.add_argument(
        "--smoke", action="store_true", help="the small preset, one rep (the test suite's run)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.reps = "small", 1
    from bench.header import print_header

    print_header("bench.paged_attention", argv, device)
    dtype = getattr(torch, args.dtype)
    hq, hkv = args.heads
    impls = ["torch"]
    if triton_available() and (device == "cuda" or triton_interpreting()):
        impls.append("triton")
    scale = args.head_dim**-0.5
    note = " (Triton interpreter: not GPU-representative)" if device == "cpu" else ""
    print(
        f"device={device} dtype={args.dtype} Hq={hq} Hkv={hkv} D={args.head_dim} "
        f"block_size={args.block_size} impls={'+'.join(impls)}" + (note if len(impls) > 1 else "")
    )
    columns = ("case", "N", "ctx", "q_len", "torch ms", "triton ms", "speedup", "KV GB/s")
    widths = (18, 5, 7, 7, 11, 11, 9, 9)
    print(format_row(columns, widths))
    print("-" * sum(widths))
    for case in PRESETS[args.preset]:
        x = make_inputs(
            case, hq=hq, hkv=hkv, d=args.head_dim, block_size=args.block_size,
            dtype=dtype, device=device,
        )  # fmt: skip
        ms = {impl: time_ms(case_fn(case, x, impl, scale), device, args.reps) for impl in impls}
        tri = ms.get("triton")
        is_decode = case.q_len == 1 and case.name != "store_kv"
        kv_bytes = 2 * case.num_seqs * case.context_len * hkv * args.head_dim
        kv_bytes *= x.k_cache.element_size()
        label = case.name + (f" s={case.num_splits}" if case.num_splits else "")
        cells = (
            label, case.num_seqs, case.context_len, case.q_len, f"{ms['torch']:.3f}",
            f"{tri:.3f}" if tri else "-",
            f"{ms['torch'] / tri:.2f}x" if tri else "-",
            f"{kv_bytes / (tri * 1e-3) / 1e9:.1f}" if tri and is_decode else "-",
        )  # fmt: skip
        print(format_row(cells, widths))


def format_row(cells: tuple[object, ...], widths: tuple[int, ...]) -> str:
    """First cell left-aligned, the rest right-aligned."""
    first, *rest = (str(c) for c in cells)
    return f"{first:<{widths[0]}}" + "".join(
        f"{c:>{w}}" for c, w in zip(rest, widths[1:], strict=True)
    )


if __name__ == "__main__":
    main()
