"""Tandem's paged generator vs transformers' batched ``generate`` on the same weights.

Both engines run in this process on one set of weights (a random Qwen3-style model written
as an HF folder by transformers and read back by ``tandem.models.hf.load_model``), on the
same batch: P prompts of varied lengths, n samples each, all submitted at once. Random
weights never say EOS, so EOS is ignored and the variants fix the lengths:

- ``fixed`` (like for like): every sample generates exactly ``--max-tokens`` tokens at
  temperature 1, so both engines compute the same tokens for the same batch.
- ``greedy`` (like for like): one sample per prompt at temperature 0, ``--max-tokens``
  tokens, the whole batch in one ``generate`` call (left-padded); ``identical`` counts the
  sequences equal token for token.
- ``grpo`` (what a GRPO user gets, not like for like): each sample stops at its own
  length, drawn from [max_tokens/4, max_tokens], as samples stop at EOS. Tandem stops each
  there and refills the batch; ``generate`` runs the batch until its longest sample ends.
  Both produce the same samples; the table prints the tokens each engine computed.

``ratio`` is transformers seconds / Tandem seconds. Each engine first runs once untimed
(``--warmup``): Tandem on the whole first variant (Triton compiles per shape class),
transformers on 2 prompts x 16 tokens. ``--layout-row`` times Tandem's other rollout-copy
layout against its default, before and after (on the CPU the fused oneDNN layout of
``rollout.cpu_onednn``; on CUDA the unfused training layout). ``--compile-row`` times its
compiled decode step (``advanced.compile_decode``; compiled in the warm-up) against the eager
one, run before and after it, and against transformers.

    python -m bench.generate --threads 2
    python -m bench.generate --threads 1 --variants fixed,greedy --compile-row
    python -m bench.generate --device cuda --dtype bfloat16 --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from bench.header import print_header
from tandem import device as seam
from tandem.models.hf import load_model
from tandem.parallel.generation_layout import inference_layout
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams


def write_model(path: str, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the table readable

    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-init weights: peaked distributions, stable greedy argmax
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(4, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.prompts)
    ]


def run_tandem(
    path: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    variant: str,
    lengths: list[int],
    other_layout: bool = False,
    compile_decode: bool = False,
) -> tuple[float, list[list[int]]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = load_model(path, device=device, dtype=dtype).eval().requires_grad_(False)
    cuda = device.type == "cuda"
    if (
        cuda != other_layout
    ):  # the trainer's rollout copy: fused on CUDA; on the CPU oneDNN is the other one
        inference_layout(model, cpu_onednn=other_layout)
    settings = GenerationSettings(
        block_size=16,
        kv_cache_gb=args.kv_cache_gb,
        max_num_seqs=256,
        max_num_batched_tokens=args.batched_tokens,
        seed=0,
        cuda_graphs=args.cuda_graphs,
        compile_decode=compile_decode,
    )
    greedy = variant == "greedy"
    n = 1 if greedy else args.n
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1
    )
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
def run_hf(
    path: str, prompts: list[list[int]], args: argparse.Namespace, variant: str, lengths: list[int]
) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        .to(device)
        .eval()
    )
    new = max(lengths) if variant == "grpo" else args.max_tokens
    kw = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    outs: list[list[int]] = []
    _sync(device)
    t0 = time.perf_counter()
    width = max(map(len, prompts))  # the whole batch in one call, left-padded
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    if variant == "greedy":
        o = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    else:  # n samples per prompt
        o = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=args.n,
            **kw,
        )
    outs = [row[width:].tolist() for row in o]
    if variant == "grpo":  # computed to the longest; each sample is its own length
        outs = [row[:n] for row, n in zip(outs, lengths)]
    _sync(device)
    return time.perf_counter() - t0, outs


def _sync(device: torch.device) -> None:
    seam.synchronize(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=seam.accelerator_type())
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
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="replay CUDA graphs for decode steps (CUDA only)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: leave as is)")
    ap.add_argument(
        "--variants", default="fixed,greedy,grpo", help="comma-separated: fixed, greedy, grpo"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs first: Tandem on the whole workload of the first "
        "variant (Triton compiles), transformers on 2 prompts x 16 tokens; 0 "
        "times the cold first run",
    )
    ap.add_argument(
        "--layout-row",
        action="store_true",
        help="also time Tandem's other rollout-copy layout (CPU: oneDNN; CUDA: unfused)",
    )
    ap.add_argument(
        "--compile-row",
        action="store_true",
        help="also time Tandem with its compiled decode step (advanced.compile_decode = true), "
        "eager before and after it, against transformers",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny model and workload (the test suite's run)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.hidden, args.layers, args.prompts, args.n = 512, 64, 1, 2, 2
        args.min_prompt, args.max_prompt, args.max_tokens, args.layout_row = 4, 8, 8, True
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header("bench.generate", argv, args.device)
    prompts = workload(args)
    rng = random.Random(1)
    lengths = [
        rng.randint(max(1, args.max_tokens // 4), args.max_tokens)
        for _ in range(len(prompts) * args.n)
    ]
    rows, layout_rows, compile_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(tmp, args)
        small = argparse.Namespace(**{**vars(args), "max_tokens": 16, "n": 2})
        for _ in range(args.warmup):
            run_tandem(tmp, prompts, args, args.variants.split(",")[0], lengths)
            run_hf(tmp, prompts[:2], small, "fixed", lengths)
            if args.compile_row:  # compiles (the step's dynamic graph and the noise's)
                first = args.variants.split(",")[0]
                run_tandem(tmp, prompts, args, first, lengths, compile_decode=True)
        for variant in args.variants.split(","):
            t_tandem, out_t = run_tandem(tmp, prompts, args, variant, lengths)
            if args.layout_row:
                t_other, out_o = run_tandem(tmp, prompts, args, variant, lengths, other_layout=True)
                t_again, _ = run_tandem(tmp, prompts, args, variant, lengths)  # after the other one
                same = sum(a == b for a, b in zip(out_t, out_o))
                layout_rows.append((variant, t_tandem, t_again, t_other, same, len(out_t)))
            t_hf, out_h = run_hf(tmp, prompts, args, variant, lengths)
            if args.compile_row:  # eager, compiled, eager again, all after transformers
                t_e1, out_e = run_tandem(tmp, prompts, args, variant, lengths)
                t_c, out_c = run_tandem(tmp, prompts, args, variant, lengths, compile_decode=True)
                t_e2, _ = run_tandem(tmp, prompts, args, variant, lengths)
                same = sum(a == b for a, b in zip(out_e, out_c))
                compile_rows.append((variant, t_e1, t_e2, t_c, t_hf, same, len(out_c)))
            n_tok = sum(map(len, out_t))
            assert n_tok == sum(map(len, out_h)), (
                "both engines must generate the same number of tokens"
            )
            hf_computed = len(out_h) * max(map(len, out_h))  # every row runs to the longest
            same = sum(a == b for a, b in zip(out_t, out_h)) if variant == "greedy" else None
            rows.append((variant, len(out_t), n_tok, hf_computed, t_tandem, t_hf, same))
    n_seqs = args.prompts * args.n
    print(
        f"device={args.device} dtype={args.dtype} model: hidden={args.hidden} "
        f"layers={args.layers} vocab={args.vocab}; {args.prompts} prompts x n={args.n}, prompt "
        f"{args.min_prompt}-{args.max_prompt} tokens, up to {args.max_tokens} new tokens, "
        f"threads={torch.get_num_threads()}; both engines take the whole batch ({n_seqs} "
        f"sequences, greedy {args.prompts}); ratio = hf s / tandem s"
    )
    print(
        f"{'variant':<8} {'seqs':>5} {'tokens':>7} {'hf computed':>12} {'tandem s':>9} "
        f"{'tandem tok/s':>13} {'hf s':>8} {'hf tok/s':>9} {'ratio':>6} {'identical':>10}"
    )
    for name, seqs, n_tok, hf_tok, tt, th, same in rows:
        ident = f"{same}/{seqs}" if same is not None else "-"
        label = name if name != "grpo" else "grpo*"
        print(
            f"{label:<8} {seqs:>5} {n_tok:>7} {hf_tok:>12} {tt:>9.2f} {n_tok / tt:>13.1f} "
            f"{th:>8.2f} {n_tok / th:>9.1f} {th / tt:>5.2f}x {ident:>10}"
        )
    if any(r[0] == "grpo" for r in rows):
        print(
            "* not like for like: the same samples, each engine's own work (generate computes "
            "every row to the longest; tok/s counts the samples' tokens)"
        )
    if layout_rows:
        other = "plain" if args.device == "cuda" else "oneDNN"
        print(
            f"{'variant':<8} {'default s':>16} {other + ' s':>9} {other + '/default':>16} "
            f"{'same tokens':>12}"
        )
        for name, t1, t2, to, same, total in layout_rows:  # default runs before and after
            print(
                f"{name:<8} {t1:>7.2f}, {t2:>6.2f} {to:>9.2f} {to / ((t1 + t2) / 2):>15.2f}x "
                f"{f'{same}/{total}':>12}"
            )
    if compile_rows:
        print_compile_rows(compile_rows)


def print_compile_rows(rows: list[tuple]) -> None:
    """Eager (before and after) vs compiled decode steps (`advanced.compile_decode`) vs
    transformers, like for like; ratios against transformers and against eager."""
    print(
        f"{'variant':<8} {'eager s':>13} {'compiled s':>11} {'hf s':>7} {'hf/eager':>9} "
        f"{'hf/compiled':>12} {'eager/compiled':>15} {'same tokens':>12}"
    )
    for name, e1, e2, tc, th, same, total in rows:
        eager = (e1 + e2) / 2
        print(
            f"{name:<8} {e1:>6.2f},{e2:>6.2f} {tc:>11.2f} {th:>7.2f} {th / eager:>8.2f}x "
            f"{th / tc:>11.2f}x {eager / tc:>14.2f}x {f'{same}/{total}':>12}"
        )


if __name__ == "__main__":
    main()
