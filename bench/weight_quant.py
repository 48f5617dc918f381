"""Low-bit generation weights (rollout.weight_dtype): resident bytes and rollout time per format.

A random Qwen3-style policy (``--hidden``, ``--layers``) is copied into the generation layout by
`tandem.parallel.generation_layout.GenerationCopy` once per format of
`tandem.kernels.weight_quant` (``bf16``: the copy in ``--dtype``, unquantized, the reference),
then generates ``--seqs`` completions of exactly ``--length`` tokens after 64-token prompts.
The table gives, per format, the projections' resident bytes measured from the copy's tensors,
the whole copy's, their ratio to the reference, and the rollout's seconds (the fastest of
``--repeats``) and its ratio to the reference's (measured in the same command, so the ratio
survives a busy machine; absolute times do not). The projections dequantize on every call in
PyTorch (the Triton product of tandem/kernels/triton_weight_quant.py runs only when forced), so
on the CPU the time ratio is the dequantization's cost.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m bench.weight_quant
    python -m bench.weight_quant --dtype bfloat16 --hidden 1024 --layers 8 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem import device as seam
from tandem.kernels.weight_quant import FORMATS, WEIGHT_DTYPES
from tandem.models.args import ModelArgs
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams

PROMPT = 64


def policy(args: argparse.Namespace) -> Transformer:
    margs = ModelArgs(
        model_type="qwen3",
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=args.length + PROMPT + 8,
    )
    with torch.device(args.device):
        model = Transformer(margs)
    model.init_weights(seed=0)
    return model.to(getattr(torch, args.dtype))


def resident(gen: torch.nn.Module) -> tuple[int, int]:
    """(the projections' bytes, the whole copy's bytes), from the tensors the copy holds."""
    seen: set[int] = set()
    proj = total = 0
    for name, t in [*gen.named_parameters(), *gen.named_buffers()]:
        if t.data_ptr() in seen or name.startswith("rope."):
            continue
        seen.add(t.data_ptr())
        n = t.numel() * t.element_size()
        total += n
        if ".attention.w" in name or ".feed_forward.w" in name:
            proj += n
    return proj, total


def rollout(gen: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> float:
    settings = GenerationSettings(
        block_size=16,
        kv_cache_gb=0.5,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        max_model_len=PROMPT + args.length + 1,
        cuda_graphs=False,
    )
    g = Generator(gen, settings)
    params = SamplingParams(temperature=1.0, max_tokens=args.length, ignore_eos=True, seed=0)
    seam.synchronize(args.device)
    t0 = time.perf_counter()
    out = g.generate(prompts, params)
    seam.synchronize(args.device)
    dt = time.perf_counter() - t0
    assert sum(len(c.token_ids) for group in out for c in group) == args.length * len(prompts)
    g.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=seam.accelerator_type())
    ap.add_argument("--dtype", default="float32", help="the policy's and the bf16 copy's dtype")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--length", type=int, default=128, help="tokens per completion")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per format; the fastest")
    ap.add_argument("--smoke", action="store_true", help="hidden 128, 2 layers, 16 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.length, args.seqs, args.repeats = 128, 2, 16, 2, 1
    from bench.header import print_header

    print_header("bench.weight_quant", device=args.device)
    model = policy(args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 8192, (PROMPT,), generator=g).tolist() for _ in range(args.seqs)]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.dtype} on {args.device}; "
        f"{args.seqs} completions of {args.length} tokens; torch threads {torch.get_num_threads()}"
    )
    head = ("format", "proj MB", "copy MB", "proj x", "seconds", "time x")
    print("".join(f"{h:>10}" for h in head))
    ref: tuple[int, float] | None = None
    for name in WEIGHT_DTYPES:
        copy = GenerationCopy(
            model,
            model.args,
            GenerationLayout(),
            torch.device(args.device),
            weight_format=FORMATS.get(name),
        )
        gen, _ = copy.build()
        proj, total = resident(gen)
        dt = min(rollout(gen, prompts, args) for _ in range(args.repeats))
        ref = ref or (proj, dt)
        label = args.dtype if name == "bf16" else name  # bf16: the copy's dtype, unquantized
        print(
            f"{label:>10}{proj / 1e6:>10.2f}{total / 1e6:>10.2f}{ref[0] / proj:>9.2f}x"
            f"{dt:>10.3f}{dt / ref[1]:>9.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
