"""Peak memory of per-token log-prob + entropy: naive full logits vs `tandem.kernels.logprobs`.

Run from the repository root::

    python -m bench.logprobs_memory                                   # 4096 x 151936, D=256
    python -m bench.logprobs_memory --tokens 1024 --dim 128 --chunk 256
    python -m bench.logprobs_memory --device cuda --dim 4096 --dtype bf16

Each variant does one forward + backward of ``sum(a * logp + b * entropy)`` with
random ``a, b``, in a fresh subprocess, so that one variant's allocator caches
and high-water mark cannot leak into another's. Peak is measured as:

* an accelerator: ``torch.accelerator.max_memory_allocated()`` minus the allocation before the
  step (after ``reset_peak_memory_stats``): live tensor bytes, exact.
* CPU: the process RSS high-water mark ``VmHWM`` from ``/proc/self/status``,
  reset just before the step by writing ``5`` to ``/proc/self/clear_refs``,
  minus ``VmRSS`` at that moment. Large tensors are mmap-backed and returned to
  the OS on free, so this tracks live bytes closely, but it also counts page-level
  allocator slack and thread scratch; it is an upper bound, and honest about the
  temporaries autograd and the kernels really create (a saved-tensors count would
  miss those).

Both variants' peaks include what any implementation needs: ``grad_hidden``,
``grad_weight`` (``V * D * 4`` in fp32) and the outputs. Inputs are created and a
small warm-up step is run before the measurement. Variants: ``naive``
(`token_logprobs_entropy_reference`), ``chunked`` (``impl="torch"``), and on CUDA
``triton``. After the measured step, ``--repeats`` more steps are timed; the table
gives their median forward and forward + backward times. ``--triton-tiles`` adds
one Triton row per tile configuration (``BLOCK_T,BLOCK_V,BLOCK_D,warps,stages``)
to choose the defaults in `tandem.kernels.logprobs._tiles`. Record results in docs/,
not in code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from tandem import device as seam

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _sync(device: torch.device) -> None:
    seam.synchronize(device)


def _step(variant: str, h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, chunk: int) -> float:
    """One forward + backward; grads land in ``h.grad`` / ``w.grad``. Returns the
    forward's seconds (the device synchronised before and after it)."""
    from tandem.kernels.logprobs import token_logprobs_entropy, token_logprobs_entropy_reference

    g = torch.Generator(device=h.device).manual_seed(1)
    a = torch.randn(tgt.shape, generator=g, device=h.device)
    b = torch.randn(tgt.shape, generator=g, device=h.device)
    _sync(h.device)
    t0 = time.perf_counter()
    if variant == "naive":
        logp, ent = token_logprobs_entropy_reference(h, w, tgt)
    else:
        impl = "torch" if variant == "chunked" else "triton"
        logp, ent = token_logprobs_entropy(h, w, tgt, chunk_tokens=chunk, impl=impl)
    _sync(h.device)
    forward = time.perf_counter() - t0
    ((a * logp).sum() + (b * ent).sum()).backward()
    return forward


def _set_tiles(spec: str) -> None:
    """Make `tandem.kernels.logprobs` use the tiles ``BLOCK_T,BLOCK_V,BLOCK_D,warps,stages``."""
    import tandem.kernels.logprobs as lp

    bt, bv, bd, warps, stages = (int(x) for x in spec.split(","))
    default = lp._tiles

    def tiles(hidden: torch.Tensor) -> dict[str, object]:
        out = default(hidden)
        out.update(BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd, num_warps=warps, num_stages=stages)
        return out

    lp._tiles = tiles


def _worker(args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this (fresh) process."""
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.variant.startswith("triton:"):
        _set_tiles(args.variant.split(":", 1)[1])
    g = torch.Generator(device=dev).manual_seed(0)
    h = (0.5 * torch.randn(args.tokens, args.dim, generator=g, device=dev)).to(dtype)
    w = (0.05 * torch.randn(args.vocab, args.dim, generator=g, device=dev)).to(dtype)
    tgt = torch.randint(0, args.vocab, (args.tokens,), generator=g, device=dev)
    h.requires_grad_()
    w.requires_grad_()
    small = min(args.tokens, 16)  # warm-up: kernel compilation, thread pools
    _step(args.variant, h[:small].detach().requires_grad_(), w, tgt[:small], args.chunk)
    w.grad = None

    cuda = seam.memory_allocated(dev) is not None  # the device keeps allocator statistics
    if cuda:
        seam.synchronize(dev)
        seam.reset_peak_memory_stats(dev)
        base = seam.memory_allocated(dev)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kb("VmRSS") * 1024
    _step(args.variant, h, w, tgt, args.chunk)
    _sync(dev)
    peak = seam.max_memory_allocated(dev) if cuda else _rss_kb("VmHWM") * 1024
    forward, total = [], []
    for _ in range(args.repeats):
        h.grad = w.grad = None
        t0 = time.perf_counter()
        forward.append(_step(args.variant, h, w, tgt, args.chunk))
        _sync(dev)
        total.append(time.perf_counter() - t0)
    return {
        "peak_mb": (peak - base) / 2**20,
        "forward_ms": 1e3 * statistics.median(forward),
        "total_ms": 1e3 * statistics.median(total),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024, help="chunk_tokens of the torch path")
    parser.add_argument("--device", default=seam.accelerator_type())
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps after the measured one")
    parser.add_argument(
        "--triton-tiles", nargs="*", default=[], metavar="BT,BV,BD,W,S",
        help="extra Triton rows, one per tile configuration (CUDA)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="T=64, V=512, D=32 (the test suite's run)"
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: worker mode
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.vocab, args.dim, args.chunk, args.repeats = 64, 512, 32, 16, 1
    if args.variant:
        print(json.dumps(_worker(args)))
        return
    from bench.header import print_header

    print_header("bench.logprobs_memory", argv, args.device)

    variants = ["naive", "chunked"]
    if args.device.startswith("cuda"):
        variants += ["triton"] + [f"triton:{t}" for t in args.triton_tiles]
    full_mb = args.tokens * args.vocab * 4 / 2**20
    print(
        f"T={args.tokens} V={args.vocab} D={args.dim} chunk={args.chunk} "
        f"{args.dtype} on {args.device}; one [T, V] fp32 tensor = {full_mb:.0f} MB"
    )
    print(f"{'variant':<24}{'peak MB':>10}{'fwd ms':>10}{'fwd+bwd ms':>12}")
    results: dict[str, dict[str, float]] = {}
    for v in variants:
        cmd = [
            sys.executable,
            "-m",
            "bench.logprobs_memory",
            *(argv or sys.argv[1:]),
            "--variant",
            v,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{v:<24}{'failed':>10}   {proc.stderr.strip().splitlines()[-1:]}")
            continue
        results[v] = r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{v:<24}{r['peak_mb']:>10.1f}{r['forward_ms']:>10.2f}{r['total_ms']:>12.2f}")
    for v in variants[1:]:
        if v in results and "naive" in results:
            peak = results["naive"]["peak_mb"] / max(results[v]["peak_mb"], 1e-9)
            speed = results["naive"]["total_ms"] / max(results[v]["total_ms"], 1e-9)
            print(f"naive / {v}: peak {peak:.1f}x, time {speed:.2f}x")


if __name__ == "__main__":
    main()
