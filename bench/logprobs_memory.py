"""Peak memory of per-token log-prob + entropy: naive full logits vs `kernels.logprobs`.

Run from the repository root::

    python -m bench.logprobs_memory                                   # 4096 x 151936, D=256
    python -m bench.logprobs_memory --tokens 1024 --dim 128 --chunk 256
    python -m bench.logprobs_memory --device cuda --dim 4096 --dtype bf16

Each variant does one forward + backward of ``sum(a * logp + b * entropy)`` with
random ``a, b``, in a fresh subprocess, so that one variant's allocator caches
and high-water mark cannot leak into another's. Peak is measured as:

* CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocation before the
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
``triton``. Record results in docs/, not in code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _step(variant: str, h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, chunk: int) -> None:
    """One forward + backward; grads land in ``h.grad`` / ``w.grad``."""
    from kernels.logprobs import token_logprobs_entropy, token_logprobs_entropy_reference

    if variant == "naive":
        logp, ent = token_logprobs_entropy_reference(h, w, tgt)
    else:
        impl = "torch" if variant == "chunked" else "triton"
        logp, ent = token_logprobs_entropy(h, w, tgt, chunk_tokens=chunk, impl=impl)
    g = torch.Generator(device=h.device).manual_seed(1)
    a = torch.randn(logp.shape, generator=g, device=h.device)
    b = torch.randn(logp.shape, generator=g, device=h.device)
    ((a * logp).sum() + (b * ent).sum()).backward()


def _worker(args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this (fresh) process."""
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    h = (0.5 * torch.randn(args.tokens, args.dim, generator=g, device=dev)).to(dtype)
    w = (0.05 * torch.randn(args.vocab, args.dim, generator=g, device=dev)).to(dtype)
    tgt = torch.randint(0, args.vocab, (args.tokens,), generator=g, device=dev)
    h.requires_grad_()
    w.requires_grad_()
    small = min(args.tokens, 16)  # warm-up: kernel compilation, thread pools
    _step(args.variant, h[:small].detach().requires_grad_(), w, tgt[:small], args.chunk)
    w.grad = None

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    _step(args.variant, h, w, tgt, args.chunk)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_kb("VmHWM") * 1024
    return {"peak_mb": (peak - base) / 2**20, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024, help="chunk_tokens of the torch path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: worker mode
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(_worker(args)))
        return

    variants = ["naive", "chunked"] + (["triton"] if args.device.startswith("cuda") else [])
    full_mb = args.tokens * args.vocab * 4 / 2**20
    print(
        f"T={args.tokens} V={args.vocab} D={args.dim} chunk={args.chunk} "
        f"{args.dtype} on {args.device}; one [T, V] fp32 tensor = {full_mb:.0f} MB"
    )
    print(f"{'variant':<10}{'peak MB':>12}{'time s':>10}")
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
            print(f"{v:<10}{'failed':>12}   {proc.stderr.strip().splitlines()[-1:]}")
            continue
        results[v] = r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{v:<10}{r['peak_mb']:>12.1f}{r['seconds']:>10.2f}")
    for v in variants[1:]:
        if v in results and "naive" in results:
            ratio = results["naive"]["peak_mb"] / max(results[v]["peak_mb"], 1e-9)
            print(f"naive / {v} peak: {ratio:.1f}x")


if __name__ == "__main__":
    main()
