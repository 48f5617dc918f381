"""Decode speed and KV-cache bytes per sequence of each model family against a dense model.

Run from the repository root::

    python -m bench.families                  # debug flavors, 8 sequences, 64 new tokens
    python -m bench.families --smoke          # the test suite's run (2 sequences, 4 tokens)

Each debug flavor (from-scratch weights, fp32, CPU) generates greedily with the in-house
generator: ``--seqs`` prompts of ``--prompt`` tokens, ``--tokens`` new tokens each (the first
generate call warms up, the second is timed). ``tok/s`` counts generated tokens over the
timed call; ``cache B/seq`` is what the paged pool holds for one full sequence (prompt +
completion) of that flavor, and ``latent B/seq`` what MLA's compressed cache would hold
(``kv_lora_rank + qk_rope_head_dim`` per token and layer; the generator keeps decompressed
K/V today, docs/models.md). Ratios are against ``debug-qwen3`` (a dense model of the same
hidden size): ``speed`` = family tok/s / dense tok/s, ``bytes`` = family cache / dense cache.
GPT-OSS decodes through the PyTorch sink path (no decode mirror), which its speed shows.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.header import print_header
from tandem.models import Transformer, get_flavor
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.kv_cache import KVCache
from tandem.rl.generator.sequence import SamplingParams

FLAVORS = ["debug-qwen3", "debug-qwen3-moe", "debug-gpt-oss", "debug-deepseek-v3"]
BLOCK = 16


def measure(flavor: str, seqs: int, prompt: int, tokens: int) -> tuple[float, int, int]:
    """(generated tokens per second, cache bytes per sequence, MLA latent bytes or 0)."""
    args = get_flavor(flavor)
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    gen = Generator(model, GenerationSettings(block_size=BLOCK, num_blocks=1024))
    prompts = [[(7 * i + j) % 300 + 3 for j in range(prompt)] for i in range(seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    gen.generate(prompts, params)  # warm-up
    t0 = time.perf_counter()
    out = gen.generate(prompts, params)
    seconds = time.perf_counter() - t0
    made = sum(len(c.token_ids) for g in out for c in g)
    per_token = KVCache.bytes_per_block(args, BLOCK, torch.float32) // BLOCK
    latent = (args.kv_lora_rank + args.qk_rope_head_dim) * args.num_layers * 4 if args.is_mla else 0
    return made / seconds, per_token * (prompt + tokens), latent * (prompt + tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="2 sequences, 4 tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqs, args.prompt, args.tokens = 2, 8, 4
    print_header("bench.families", argv, "cpu")
    print(f"{args.seqs} sequences, {args.prompt} prompt + {args.tokens} new tokens, fp32, CPU")
    print(
        f"{'flavor':<20}{'tok/s':>9}{'cache B/seq':>13}{'latent B/seq':>14}{'speed':>8}{'bytes':>8}"
    )
    base: tuple[float, int, int] | None = None
    for flavor in FLAVORS:
        speed, cache, latent = measure(flavor, args.seqs, args.prompt, args.tokens)
        base = base or (speed, cache, latent)
        print(
            f"{flavor:<20}{speed:>9.1f}{cache:>13,}{f'{latent:,}' if latent else '-':>14}"
            f"{speed / base[0]:>7.2f}x{cache / base[1]:>7.2f}x"
        )


if __name__ == "__main__":
    main()
