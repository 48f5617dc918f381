"""Tandem's paged generator vs transformers' ``generate`` on the same weights.

A GRPO-shaped workload: P prompts of varied lengths, n samples each, up to
``--max-tokens`` new tokens at temperature 1. Both engines run in this process
on one set of weights: a random Qwen3-style model written as an HF folder with
transformers and read back by ``tandem.models.hf.load_model``. Random weights never
say EOS, so EOS is ignored and three variants fix the lengths instead:

- ``grpo``: each sample stops at its own length, drawn uniformly from
  [max_tokens/4, max_tokens], as GRPO samples stop at EOS at different points.
  Tandem stops each sequence there (a stop check, as EOS would) and fills the
  freed batch slots; transformers' batch runs until its longest sample ends
  (what ``generate`` does when samples hit EOS at different steps), and only
  the tokens inside each sample's length count as generated.
- ``fixed``: every sample generates exactly ``--max-tokens`` tokens (no length
  variation: the engines' per-step costs alone).
- ``greedy``: one sample per prompt, temperature 0, ``--max-tokens`` tokens;
  transformers runs one prompt at a time (no padding, so an exact reference)
  and the ``identical`` column counts sequences equal token for token.

Run from the repository root::

    python -m bench.generate                 # default CPU-sized workload
    python -m bench.generate --device cuda --dtype bfloat16 --hidden 1024 --layers 16

Prints one row per (engine, variant) with seconds and generated tokens/s, the
Tandem/transformers ratio, and for greedy how many sequences are identical
token for token (transformers runs the greedy variant one prompt at a time, so
its left padding cannot perturb the comparison). Each engine first runs once,
untimed (``--warmup``): Tandem on the whole workload of the first variant, since
its Triton kernels compile per shape class (on an H200 a warm-up of 2 prompts x
16 tokens still left about 1.1 s of compiling in the first timed run),
transformers on 2 prompts x 16 tokens for the library's first-call setup. ``--layout-row`` adds a
table timing Tandem on the training layout (no `tandem.parallel.generation_layout.inference_layout`:
q/k/v and gate/up as separate products, no oneDNN) against its default runs
before and after it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from tandem.models.hf import load_model
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.parallel.generation_layout import inference_layout


def write_model(path: str, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-init weights: peaked distributions, stable greedy argmax
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.prompts)]


def run_tandem(path: str, prompts: list[list[int]], args: argparse.Namespace, variant: str,
               lengths: list[int], layout: bool = True) -> tuple[float, list[list[int]]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = load_model(path, device=device, dtype=dtype).eval().requires_grad_(False)
    if layout:  # what the trainer's rollout copy gets
        inference_layout(model)
    settings = GenerationSettings(block_size=16, kv_cache_gb=args.kv_cache_gb, max_num_seqs=256,
                                  max_num_batched_tokens=args.batched_tokens, seed=0, cuda_graphs=args.cuda_graphs)
    greedy = variant == "greedy"
    n = 1 if greedy else args.n
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    gen = Generator(model, settings)
    check = None
    if variant == "grpo":  # seq ids are assigned in order: prompt-major, sample-minor
        check = lambda seq: len(seq.completion_token_ids) >= lengths[seq.seq_id]  # noqa: E731
    _sync(device)
    t0 = time.perf_counter()
    out = gen.generate(prompts, params, n=n, stop_check=check)
    _sync(device)
    dt = time.perf_counter() - t0
    assert gen.pool_is_free()
    gen.close()
    return dt, [c.token_ids for group in out for c in group]


@torch.inference_mode()
def run_hf(path: str, prompts: list[list[int]], args: argparse.Namespace, variant: str,
           lengths: list[int]) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    new = max(lengths) if variant == "grpo" else args.max_tokens
    kw = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    outs: list[list[int]] = []
    _sync(device)
    t0 = time.perf_counter()
    if variant == "greedy":  # one prompt at a time: no padding, an exact reference
        for p in prompts:
            ids = torch.tensor([p], device=device)
            o = model.generate(ids, do_sample=False, **kw)
            outs.append(o[0, len(p):].tolist())
    else:  # the whole batch at once, left-padded, n samples per prompt
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        o = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           num_return_sequences=args.n, **kw)
        outs = [row[width:].tolist() for row in o]
        if variant == "grpo":
            outs = [row[:n] for row, n in zip(outs, lengths)]
    _sync(device)
    return time.perf_counter() - t0, outs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay CUDA graphs for decode steps (CUDA only)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: leave as is)")
    ap.add_argument("--variants", default="grpo,fixed,greedy", help="comma-separated: grpo, fixed, greedy")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs first: Tandem on the whole workload of the first variant (Triton "
                         "compiles), transformers on 2 prompts x 16 tokens; 0 times the cold first run")
    ap.add_argument("--layout-row", action="store_true",
                    help="also time Tandem without the rollout copy's inference layout")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = workload(args)
    rng = random.Random(1)
    lengths = [rng.randint(max(1, args.max_tokens // 4), args.max_tokens) for _ in range(len(prompts) * args.n)]
    rows, layout_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(tmp, args)
        small = argparse.Namespace(**{**vars(args), "max_tokens": 16, "n": 2})
        for _ in range(args.warmup):
            run_tandem(tmp, prompts, args, args.variants.split(",")[0], lengths)
            run_hf(tmp, prompts[:2], small, "fixed", lengths)
        for variant in args.variants.split(","):
            t_tandem, out_t = run_tandem(tmp, prompts, args, variant, lengths)
            if args.layout_row:
                t_plain, out_p = run_tandem(tmp, prompts, args, variant, lengths, layout=False)
                t_again, _ = run_tandem(tmp, prompts, args, variant, lengths)  # after the plain run
                same = sum(a == b for a, b in zip(out_t, out_p))
                layout_rows.append((variant, t_tandem, t_again, t_plain, same, len(out_t)))
            t_hf, out_h = run_hf(tmp, prompts, args, variant, lengths)
            n_tok = sum(map(len, out_t))
            assert n_tok == sum(map(len, out_h)), "both engines must generate the same number of tokens"
            same = sum(a == b for a, b in zip(out_t, out_h)) if variant == "greedy" else None
            rows.append((variant, n_tok, t_tandem, t_hf, same, len(out_t)))
    print(f"device={args.device} dtype={args.dtype} model: hidden={args.hidden} layers={args.layers} "
          f"vocab={args.vocab}; {args.prompts} prompts x n={args.n}, prompt {args.min_prompt}-{args.max_prompt} "
          f"tokens, up to {args.max_tokens} new tokens, threads={torch.get_num_threads()}")
    print(f"{'variant':<8} {'tokens':>7} {'tandem s':>9} {'tandem tok/s':>13} {'hf s':>8} {'hf tok/s':>9} "
          f"{'ratio':>6} {'identical':>10}")
    for name, n_tok, tt, th, same, total in rows:
        ident = f"{same}/{total}" if same is not None else "-"
        print(f"{name:<8} {n_tok:>7} {tt:>9.2f} {n_tok / tt:>13.1f} {th:>8.2f} {n_tok / th:>9.1f} "
              f"{th / tt:>5.2f}x {ident:>10}")
    if layout_rows:
        print(f"{'variant':<8} {'layout s':>14} {'plain s':>8} {'plain/layout':>13} {'same tokens':>12}")
        for name, t1, t2, tp, same, total in layout_rows:  # default runs before and after the plain one
            print(f"{name:<8} {t1:>6.2f}, {t2:>6.2f} {tp:>8.2f} {tp / ((t1 + t2) / 2):>12.2f}x "
                  f"{f'{same}/{total}':>12}")


if __name__ == "__main__":
    main()
