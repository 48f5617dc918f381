"""MoE layer and grouped GEMM, forward + backward: grouped kernels against a per-expert loop.

Run from the repository root::

    python -m bench.moe                                   # default shapes, CPU
    python -m bench.moe --shapes 4096,2048,768,128,8      # T,D,I,E,k (Qwen3-30B-A3B's layer)

For each shape ``T`` tokens, hidden ``D``, expert width ``I``, ``E`` experts, ``k``
per token (router weights random, so loads are near-uniform):

* ``gemm``: one expert projection over the ``T * k`` sorted rows, ``[T*k, D] x
  [E, D, I]``, forward and backward. ``loop``: `tandem.kernels.grouped_gemm.grouped_mm_ref`
  (a matmul per expert, autograd); ``grouped``: `grouped_mm` on its default path
  (``torch._grouped_mm`` on CPU, Triton on CUDA).
* ``layer``: the whole `tandem.models.moe.MoE` block (router, permute, three grouped
  GEMMs, unpermute), forward and backward. ``loop`` is the same block's weights run
  the way transformers' Qwen3-MoE does: per expert, gather its tokens, SwiGLU,
  weight, ``index_add`` (a host sync per layer to find the experts hit).
* ``fwd``: the same layer, forward only under ``no_grad`` (what a generator pays).

Milliseconds are the median of ``--repeats`` runs after two warm-ups; ``ratio`` is
loop / grouped; on CUDA also the grouped path's TFLOP/s (matmul FLOPs only).
Record results in docs/performance.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.paged_attention import time_ms
from tandem.kernels.grouped_gemm import grouped_mm, grouped_mm_ref, permute_tokens
from tandem.models.args import ModelArgs
from tandem.models.moe import MoE

DEFAULT_SHAPES = ["2048,512,256,16,2", "2048,256,128,64,8", "1024,256,96,128,8", "64,512,256,64,8"]


def _time(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    return time_ms(fn, device.type, repeats)


def loop_moe(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop (transformers' eager Qwen3-MoE experts) with ``block``'s weights."""
    flat = x.reshape(-1, x.shape[-1])  # [T, D]
    _, _, ids, weights = block.route(flat)
    out = torch.zeros_like(flat)
    # unbind once: indexing w1[e] per expert would make each backward build a full [E, I, D] zero grad.
    w1, w2, w3 = (w.unbind(0) for w in (block.experts.w1, block.experts.w2, block.experts.w3))
    for e in torch.unique(ids).tolist():  # host sync
        token, slot = torch.where(ids == e)
        h = flat[token]
        y = F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out.view(x.shape)


def _fwd_bwd(fn, inputs: list[torch.Tensor]):  # noqa: ANN001, ANN202
    def run() -> None:
        for t in inputs:
            t.grad = None
        fn().square().mean().backward()

    return run


def bench_shape(t: int, d: int, i: int, e: int, k: int, device: torch.device, dtype: torch.dtype,
                repeats: int) -> list[tuple[str, float, float, float | None]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)  # [T, k]
    order, offsets = permute_tokens(ids, e)
    x = torch.randn(t * k, d, generator=g).to(device, dtype).requires_grad_()
    w = (0.05 * torch.randn(e, d, i, generator=g)).to(device, dtype).requires_grad_()
    gemm_flops = 3 * 2 * t * k * d * i  # forward + two backward GEMMs
    rows = []
    loop = _time(_fwd_bwd(lambda: grouped_mm_ref(x, w, offsets), [x, w]), device, repeats)
    grouped = _time(_fwd_bwd(lambda: grouped_mm(x, w, offsets), [x, w]), device, repeats)
    rows.append(("gemm", loop, grouped, gemm_flops / grouped / 1e9 if device.type == "cuda" else None))

    args = ModelArgs(model_type="qwen3_moe", hidden_size=d, num_heads=max(1, d // 64), num_experts=e,
                     num_experts_per_tok=k, moe_intermediate_size=i, norm_topk_prob=True)
    torch.manual_seed(0)
    block = MoE(args).to(device, dtype)
    block.init_weights(0.05)
    torch.nn.init.normal_(block.gate.weight, std=0.05)
    h = torch.randn(1, t, d, generator=g).to(device, dtype).requires_grad_()
    params = [h, *block.parameters()]
    loop = _time(_fwd_bwd(lambda: loop_moe(block, h), params), device, repeats)
    grouped = _time(_fwd_bwd(lambda: block(h), params), device, repeats)
    layer_flops = 3 * gemm_flops + 3 * 2 * t * d * e  # three projections + router
    rows.append(("layer", loop, grouped, layer_flops / grouped / 1e9 if device.type == "cuda" else None))
    with torch.no_grad():
        loop = _time(lambda: loop_moe(block, h), device, repeats)
        grouped = _time(lambda: block(h), device, repeats)
    rows.append(("fwd", loop, grouped, layer_flops / 3 / grouped / 1e9 if device.type == "cuda" else None))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,D,I,E,k each")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadiest on a shared box)")
    opts = ap.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    print(f"{device} {dtype}, {torch.get_num_threads()} threads; forward + backward, ms, median of {opts.repeats}")
    print(f"{'T,D,I,E,k':>22}{'what':>7}{'loop ms':>10}{'grouped ms':>12}{'ratio':>8}{'TFLOP/s':>9}")
    for shape in opts.shapes:
        t, d, i, e, k = (int(v) for v in shape.split(","))
        for what, loop, grouped, tflops in bench_shape(t, d, i, e, k, device, dtype, opts.repeats):
            tf = f"{tflops:>9.1f}" if tflops is not None else f"{'-':>9}"
            print(f"{shape:>22}{what:>7}{loop:>10.2f}{grouped:>12.2f}{loop / grouped:>7.2f}x{tf}")


if __name__ == "__main__":
    main()
