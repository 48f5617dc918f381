"""MoE layer and grouped GEMM, forward + backward: Tandem's grouped kernels against fair references.

Run from the repository root::

    python -m bench.moe --threads 1                       # default shapes, CPU
    python -m bench.moe --shapes 4096,2048,768,128,8      # T,D,I,E,k (Qwen3-30B-A3B's layer)

For each shape ``T`` tokens, hidden ``D``, expert width ``I``, ``E`` experts, ``k``
per token (router weights random, so loads are near-uniform):

* ``gemm``: one expert projection over the ``T * k`` sorted rows, ``[T*k, D] x [E, D, I]``,
  forward and backward. Reference: `tandem.kernels.grouped_gemm.grouped_mm_ref`, a matmul per
  expert on the input split into its runs (no full-size zero gradient per slice); Tandem:
  `grouped_mm` on its default path (``torch._grouped_mm`` on CPU, Triton on CUDA).
* ``layer``: the whole `tandem.models.moe.MoE` block (router, permute, three grouped GEMMs,
  unpermute) against transformers' ``Qwen3MoeSparseMoeBlock`` holding the same weights, in
  the experts implementation a transformers model resolves by default (``hf default``:
  ``grouped_mm`` where torch has it) and in its ``eager`` per-expert loop (what a user who
  asks for eager gets; it indexes the weights per expert). Outputs are checked equal first.
* ``fwd``: the same layers, forward only under ``no_grad`` (what a generator pays).

Milliseconds are the median of ``--repeats`` runs after two warm-ups; ``ratio`` is reference /
Tandem; on CUDA also Tandem's TFLOP/s (matmul FLOPs only).
"""

from __future__ import annotations

import argparse

import torch

from bench.header import print_header
from bench.paged_attention import time_ms
from tandem import device as seam
from tandem.kernels.grouped_gemm import grouped_mm, grouped_mm_ref, permute_tokens
from tandem.models.args import ModelArgs
from tandem.models.moe import MoE

DEFAULT_SHAPES = ["2048,512,256,16,2", "2048,256,128,64,8", "1024,256,96,128,8", "64,512,256,64,8"]


def _time(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    return time_ms(fn, device.type, repeats)


def hf_block(block: MoE, impl: str | None) -> torch.nn.Module:
    """transformers' Qwen3-MoE block with ``block``'s weights; ``impl`` None: the experts
    implementation a model built by ``from_config`` resolves by default."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    e, i, d = block.experts.w1.shape
    cfg = Qwen3MoeConfig(
        vocab_size=8,
        hidden_size=d,
        intermediate_size=i,
        moe_intermediate_size=i,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=e,
        num_experts_per_tok=block.top_k,
        norm_topk_prob=True,
        experts_implementation=impl,
    )
    hf = AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp
    w = block.experts
    with torch.no_grad():
        hf.gate.weight.copy_(block.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([w.w1, w.w3], dim=1))  # [E, 2I, D]
        hf.experts.down_proj.copy_(w.w2)  # [E, D, I]
    return hf.to(w.w1.device, w.w1.dtype)


def _fwd_bwd(fn, inputs: list[torch.Tensor]):  # noqa: ANN001, ANN202
    def run() -> None:
        for t in inputs:
            t.grad = None
        fn().square().mean().backward()

    return run


def bench_shape(
    t: int, d: int, i: int, e: int, k: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[tuple[str, str, float, float, float | None]]:
    """(what, reference, reference ms, Tandem ms, Tandem TFLOP/s on CUDA) rows of one shape."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)  # [T, k]
    order, offsets = permute_tokens(ids, e)
    x = torch.randn(t * k, d, generator=g).to(device, dtype).requires_grad_()
    w = (0.05 * torch.randn(e, d, i, generator=g)).to(device, dtype).requires_grad_()
    cuda = device.type == "cuda"
    gemm_flops = 3 * 2 * t * k * d * i  # forward + two backward GEMMs
    loop = _time(_fwd_bwd(lambda: grouped_mm_ref(x, w, offsets), [x, w]), device, repeats)
    grouped = _time(_fwd_bwd(lambda: grouped_mm(x, w, offsets), [x, w]), device, repeats)
    rows = [("gemm", "loop (split)", loop, grouped, gemm_flops / grouped / 1e9 if cuda else None)]

    args = ModelArgs(
        model_type="qwen3_moe",
        hidden_size=d,
        num_heads=max(1, d // 64),
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=i,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = MoE(args).to(device, dtype)
    block.init_weights(0.05)
    torch.nn.init.normal_(block.gate.weight, std=0.05)
    h = torch.randn(1, t, d, generator=g).to(device, dtype).requires_grad_()
    layer_flops = 3 * gemm_flops + 3 * 2 * t * d * e  # three projections + router
    ours = _time(_fwd_bwd(lambda: block(h), [h, *block.parameters()]), device, repeats)
    with torch.no_grad():
        ours_fwd = _time(lambda: block(h), device, repeats)
        want = block(h)
    for label, impl in (("hf default", None), ("hf eager", "eager")):
        hf = hf_block(block, impl)
        with torch.no_grad():  # the same layer: same outputs (fp32 sums in another order)
            torch.testing.assert_close(
                hf(h), want, rtol=1e-2 if dtype != torch.float32 else 1e-4, atol=1e-3
            )
        name = label if impl else f"{label}: {hf.experts.config._experts_implementation}"
        ref = _time(_fwd_bwd(lambda hf=hf: hf(h), [h, *hf.parameters()]), device, repeats)
        rows.append(("layer", name, ref, ours, layer_flops / ours / 1e9 if cuda else None))
        with torch.no_grad():
            ref = _time(lambda hf=hf: hf(h), device, repeats)
        rows.append(
            ("fwd", name, ref, ours_fwd, layer_flops / 3 / ours_fwd / 1e9 if cuda else None)
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,D,I,E,k each")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default=seam.accelerator_type())
    ap.add_argument(
        "--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 is steadiest on a shared box)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="one tiny shape, one repeat (the test suite's run)"
    )
    opts = ap.parse_args(argv)
    if opts.smoke:
        opts.shapes, opts.repeats = ["64,32,16,4,2"], 1
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    print_header("bench.moe", argv, opts.device)
    print(
        f"{device} {dtype}, {torch.get_num_threads()} threads; ms, median of {opts.repeats}; "
        "ratio = reference / Tandem"
    )
    print(
        f"{'T,D,I,E,k':>20}{'what':>7}  {'reference':<26}{'ref ms':>9}{'tandem ms':>11}"
        f"{'ratio':>8}{'TFLOP/s':>9}"
    )
    for shape in opts.shapes:
        t, d, i, e, k = (int(v) for v in shape.split(","))
        for what, name, ref, ours, tf in bench_shape(t, d, i, e, k, device, dtype, opts.repeats):
            tf_s = f"{tf:>9.1f}" if tf is not None else f"{'-':>9}"
            ratio = f"{ref / ours:>7.2f}x"
            print(f"{shape:>20}{what:>7}  {name:<26}{ref:>9.2f}{ours:>11.2f}{ratio}{tf_s}")


if __name__ == "__main__":
    main()
