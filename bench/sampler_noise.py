"""The sampler's Exp(1) noise: the int64 tensor hash against the one-pass Triton kernel.

Run from the repository root (the Triton row needs CUDA)::

    python -m bench.sampler_noise                       # rows 32, 64, 256 x vocab 151936
    python -m bench.sampler_noise --rows 64 --vocab 8192

For each batch of rows: milliseconds per call of
`tandem.rl.generator.sampler.exponential_noise` with ``impl="torch"`` and, on CUDA,
``impl="triton"`` (`tandem.kernels.sampling_noise`), the median of ``--repeats`` calls
after a warm-up, the ratio, and whether the recovered 23-bit uniforms agree
bit for bit. One call is what a decode step pays when the vocabulary is too
large for the sampler's lookahead. Record results in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.header import print_header
from tandem import device as seam
from tandem.rl.generator.sampler import exponential_noise


def _time(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeats):
        seam.synchronize(device)
        t0 = time.perf_counter()
        fn()
        seam.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default=seam.accelerator_type())
    ap.add_argument(
        "--smoke", action="store_true", help="4 rows of a 1024 vocabulary (the test suite's run)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.repeats = [4], 1024, 2
    print_header("bench.sampler_noise", argv, args.device)
    device = torch.device(args.device)
    triton = device.type == "cuda"
    print(f"vocab {args.vocab} on {device}; ms per call, median of {args.repeats}")
    print(f"{'rows':>6}{'torch ms':>10}{'triton ms':>11}{'ratio':>8}{'same bits':>11}")
    for n in args.rows:
        keys = [(1234, i) for i in range(n)]
        t_torch = _time(
            lambda k=keys: exponential_noise(k, args.vocab, device, impl="torch"),
            device,
            args.repeats,
        )
        if not triton:
            print(f"{n:>6}{t_torch:>10.3f}{'-':>11}{'-':>8}{'-':>11}")
            continue
        t_triton = _time(
            lambda k=keys: exponential_noise(k, args.vocab, device, impl="triton"),
            device,
            args.repeats,
        )
        a = exponential_noise(keys, args.vocab, device, impl="torch").double()
        b = exponential_noise(keys, args.vocab, device, impl="triton").double()
        same = torch.equal(
            torch.round(torch.exp(-a) * 2**23 - 0.5), torch.round(torch.exp(-b) * 2**23 - 0.5)
        )
        print(f"{n:>6}{t_torch:>10.3f}{t_triton:>11.3f}{t_torch / t_triton:>7.1f}x{str(same):>11}")


if __name__ == "__main__":
    main()
