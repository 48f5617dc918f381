"""Cost of ``rl.exact``'s batch-invariant kernels against the default ones, and whether the
default ones are batch-invariant at all on this device.

Run from the repository root::

    python -m bench.exact_kernels --device cuda --dtype bf16     # Qwen3-1.7B shapes
    python -m bench.exact_kernels                                # CPU, small shapes

Rows (milliseconds, median of ``--repeats`` after two warm-ups):

* ``mm M,N,K``: ``x [M, K] @ w.T`` by the default matmul (cuBLAS / CPU BLAS), by the exact
  mode's matmul as it would run here (the Triton kernel of `tandem.kernels.triton_batch_invariant`
  where `tandem.kernels.dispatch` picks Triton, else `tiled_mm`), for the 1.7B model's projections
  (qkv, o, gate/up, down, LM head) at decode (M = 64) and update (M = 4096) row counts;
* ``lse N,V``: ``torch.logsumexp`` against the tree `logsumexp`;
* ``attn T,L``: SDPA (causal, one sequence of L keys, the last T queries) against the exact
  attention (`tandem.kernels.batch_invariant.attention`, fixed trees over positions and head dim:
  the fused Triton kernel on CUDA, and ``attn-torch`` its PyTorch form).

``differ`` counts the default kernel's rows that change when computed alone instead of in
the batch (the problem exact mode removes); the exact kernels' must be 0, and are counted
too. Not yet run on a GPU (scripts/gpu_check.sh, part ``exact``); record results in
docs/performance.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.header import print_header
from bench.paged_attention import time_ms
from tandem import device as seam
from tandem.kernels import batch_invariant as bi

# (name, N, K) of Qwen3-1.7B's linears: hidden 2048, 16 q / 8 kv heads of 128, MLP 6144, vocab
# 151936
SHAPES_17B = [
    ("qkv", 4096, 2048),
    ("o", 2048, 2048),
    ("gate_up", 12288, 2048),
    ("down", 2048, 6144),
    ("lm_head", 151936, 2048),
]
SHAPES_SMALL = [("qkv", 256, 128), ("down", 128, 384), ("lm_head", 4096, 128)]


def _rows_differ(fn, x: torch.Tensor, rows: int = 8) -> int:  # noqa: ANN001
    """How many of the first ``rows`` rows of ``fn(x)`` change when computed alone."""
    full = fn(x)
    return sum(int(not torch.equal(fn(x[i : i + 1]), full[i : i + 1])) for i in range(rows))


def bench_mm(shapes, ms: list[int], device: str, dtype: torch.dtype, reps: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    print(
        f"{'case':28s} {'default':>9s} {'exact':>9s} {'ratio':>6s} {'differ':>7s} "
        f"{'exact differ':>12s}"
    )
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
        for m in ms:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            base = time_ms(lambda x=x, w=w: x @ w.T, device, reps)
            bad = _rows_differ(lambda t, w=w: t @ w.T, x)
            with bi.exact_mode():
                exact = time_ms(lambda x=x, w=w: x @ w.T, device, reps)
                still = _rows_differ(lambda t, w=w: t @ w.T, x)
            print(
                f"{'mm ' + name + f' {m},{n},{k}':28s} {base:9.3f} {exact:9.3f} "
                f"{exact / base:6.2f} {bad:7d} {still:12d}"
            )


def bench_reductions(
    device: str,
    dtype: torch.dtype,
    reps: int,
    vocab: int,
    heads: tuple[int, int, int],
    smoke: bool = False,
) -> None:
    g = torch.Generator().manual_seed(1)
    for n in (64,) if smoke else (64, 4096):
        z = torch.randn(n, vocab, generator=g).to(device) * 4
        base = time_ms(lambda z=z: torch.logsumexp(z, -1), device, reps)
        exact = time_ms(lambda z=z: bi.logsumexp(z), device, reps)
        bad = _rows_differ(lambda t: torch.logsumexp(t, -1), z)
        print(
            f"{f'lse {n},{vocab}':28s} {base:9.3f} {exact:9.3f} {exact / base:6.2f} {bad:7d} "
            f"{_rows_differ(bi.logsumexp, z):12d}"
        )
    hq, hkv, d = heads
    for t, length in ((1, 128),) if smoke else ((1, 1024), (64, 1024), (512, 512)):
        q = torch.randn(t, hq, d, generator=g).to(device, dtype)
        k, v = (torch.randn(length, hkv, d, generator=g).to(device, dtype) for _ in range(2))
        pos = torch.arange(length - t, length, device=device)  # the last t positions' queries
        index = torch.arange(length, device=device).expand(t, length)
        mask = torch.arange(length, device=device)[None] <= pos[:, None]  # [T, L]
        # [H, T, D], [Hkv, L, D]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        base = time_ms(
            lambda qh=qh, kh=kh, vh=vh, mask=mask: F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, enable_gqa=True
            ),
            device,
            reps,
        )
        exact = time_ms(
            lambda q=q, k=k, v=v, index=index, pos=pos: bi.attention(
                q, k, v, index, pos + 1, d**-0.5
            ),
            device,
            reps,
        )
        print(f"{f'attn {t},{length}':28s} {base:9.3f} {exact:9.3f} {exact / base:6.2f}")
        if device == "cuda":  # the PyTorch form too, which the Triton kernel replaces there
            ref = time_ms(
                lambda q=q, k=k, v=v, index=index, pos=pos: bi.attention_torch(
                    q, k, v, index, pos + 1, d**-0.5
                ),
                device,
                reps,
            )
            print(f"{f'attn-torch {t},{length}':28s} {base:9.3f} {ref:9.3f} {ref / base:6.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=seam.accelerator_type())
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="one repeat (the test suite's run)")
    a = p.parse_args(argv)
    if a.smoke:
        a.repeats = 1
    print_header("bench.exact_kernels", argv, a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    big = a.device != "cpu"
    print(
        f"device {a.device} dtype {a.dtype}" + (f" ({seam.device_name(a.device)})" if big else "")
    )
    ms = [16] if a.smoke else [64, 4096] if big else [16, 256]
    bench_mm(
        SHAPES_SMALL if a.smoke else SHAPES_17B if big else SHAPES_SMALL,
        ms,
        a.device,
        dtype,
        a.repeats,
    )
    bench_reductions(
        a.device,
        dtype,
        a.repeats,
        1024 if a.smoke else 151936 if big else 8192,
        (16, 8, 128) if big else (4, 2, 32),
        a.smoke,
    )


if __name__ == "__main__":
    main()
