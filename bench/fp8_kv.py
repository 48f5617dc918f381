"""FP8 KV pool: capacity and rollout time at long completions, with and without it.

A random Qwen3-style model (``--hidden``, ``--layers``; head_dim 64, two KV heads) in the
rollout copy's layout (`tandem.parallel.generation_layout.inference_layout`) generates ``--seqs``
completions of exactly L tokens (EOS ignored) after 64-token prompts, for each L of
``--lengths``, with the KV pool in:

- ``default``: the generation dtype (``--dtype``; fp32 on the CPU, where decode steps also
  read the contiguous rows of `tandem.rl.generator.decode_mirror`) -- the reference;
- ``fp8``: ``rollout.kv_dtype = "fp8_e4m3"`` with calibrated per-(layer, head) scales
  (the amax of a forward over the prompts, as the trainer's calibration takes it);
- ``fp8/token``: the same with ``rollout.kv_scales = "per_token"``.

Two pool sizes per length: ``room`` (``--kv-cache-gb``, which holds every sequence in every
format: the cost of reading FP8 pages) and ``tight`` (the bytes that ``default`` needs for
half of the sequences: it preempts and recomputes or queues, while FP8 holds four times as
many tokens per byte as fp32, twice bf16's, so every sequence fits). ``--formats`` picks the
rows of the time table. The first table is capacity: full-length sequences that
``--kv-cache-gb`` holds per format (bf16 listed for the GPU's default); the second, rollout
time, with each FP8 row's time over the default row's of the same length and pool (the
ratio, measured in the same command, survives a busy machine; absolute times do not).

``--accuracy [DIR]`` prints instead what FP8 rounding does to a quickstart policy
(assets/quickstart-policy, or DIR, e.g. the quickstart's export): its greedy answers to the
100 held-out problems the quickstart evaluates on, with K, V or both rounded as an FP8 pool
rounds them (per-token scales, through the training forward: what the pool gives,
tests/generator/test_fp8_kv_gap.py), and how many are wrong, and how many of those are a
wrong number rather than the policy's stray "!" habit.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m bench.fp8_kv                # CPU: 2k, 4k and 8k-token completions
    python -m bench.fp8_kv --lengths 256 --seqs 2           # a quick look
    python -m bench.fp8_kv --accuracy                       # the shipped quickstart policy
    python -m bench.fp8_kv --accuracy outputs/quickstart/hf # ... or one trained by the quickstart
    python -m bench.fp8_kv --device cuda --dtype bfloat16 --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem import device as seam
from tandem.kernels import kv_quant as kvq
from tandem.models.args import ModelArgs
from tandem.models.attention import CausalAttention
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import inference_layout
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.kv_cache import KVCache, KVQuant
from tandem.rl.generator.sequence import SamplingParams

PROMPT = 64
FORMATS = {
    "default": None,
    "fp8": ("fp8_e4m3", "calibrated"),
    "fp8/token": ("fp8_e4m3", "per_token"),
}


def build(args: argparse.Namespace) -> Transformer:
    margs = ModelArgs(
        model_type="qwen3",
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=max(args.lengths) + PROMPT + 8,
    )
    with torch.device(args.device):
        model = Transformer(margs)
    model.init_weights(seed=0)
    model = model.to(getattr(torch, args.dtype)).eval().requires_grad_(False)
    inference_layout(model)
    return model


@torch.no_grad()
def calibrate(model: Transformer, prompts: list[list[int]], device: str) -> torch.Tensor:
    """Per-(layer, K/V, head) power-of-two scales from the amax of a forward over the prompts."""
    a = model.args
    amax = torch.zeros(a.num_layers, 2, a.num_kv_heads, device=device)
    for p in prompts:
        model(torch.tensor([p], device=device), attn=kvq.KVAmaxObserver(CausalAttention(), amax))
    return kvq.scale_from_amax(amax.cpu(), torch.float8_e4m3fn)


def capacity(
    model: Transformer,
    length: int,
    gb: float,
    block: int,
    dtype: torch.dtype,
    quant: KVQuant | None,
) -> int:
    per_seq = -(-(PROMPT + length + 1) // block)
    return int(gb * 1e9 // KVCache.bytes_per_block(model.args, block, dtype, quant)) // per_seq


def run(
    model: Transformer,
    prompts: list[list[int]],
    length: int,
    fmt: tuple[str, str] | None,
    scales: torch.Tensor,
    gb: float,
    args: argparse.Namespace,
) -> tuple[float, int, int]:
    """(seconds, generated tokens, preemptions) of one generation."""
    kv_dtype, kv_scales = fmt or ("auto", "calibrated")
    settings = GenerationSettings(
        block_size=args.block_size,
        kv_cache_gb=gb,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        max_model_len=PROMPT + length + 1,
        kv_dtype=kv_dtype,
        kv_scales=kv_scales,
        cuda_graphs=args.device == "cuda",
    )
    gen = Generator(model, settings, kv_scales=scales if kv_scales == "calibrated" else None)
    params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=0)
    seam.synchronize(args.device)
    t0 = time.perf_counter()
    out = gen.generate(prompts, params)
    seam.synchronize(args.device)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for group in out for c in group)
    assert tokens == length * len(prompts), tokens
    preempted = gen.stats.preemptions
    gen.close()
    return dt, tokens, preempted


def accuracy(path: str) -> None:
    """Wrong greedy answers of a quickstart policy to its 100 held-out problems, per rounding."""
    from tandem.models.hf import load_model
    from tandem.models.tokenizer import Tokenizer
    from tandem.rl.data.prompts import encode_prompts, load_prompt_rows

    model, tok = load_model(path).eval(), Tokenizer.from_dir(path)
    rows = load_prompt_rows(
        "synthetic:addition_small?max_value=19", "auto", split="test", seed=1, n_synthetic=100
    )
    prompts, _ = encode_prompts(
        rows,
        tok,
        source="held-out",
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=120,
        on_bad_row="error",
    )

    class Rounded:  # K and/or V through the pool's rounding (per-token scales), then causal SDPA
        def __init__(self, k: bool, v: bool, dtype: torch.dtype) -> None:
            self.k, self.v, self.dtype = k, v, dtype

        def __call__(self, layer, q, k, v):  # noqa: ANN001, ANN204
            k = kvq.fake_quant(k, self.dtype, None) if self.k else k
            v = kvq.fake_quant(v, self.dtype, None) if self.v else v
            return CausalAttention()(layer, q, k, v)

    @torch.no_grad()
    def answer(ids: list[int], attn: Rounded) -> str:
        out: list[int] = []
        for _ in range(6):
            nxt = int(model(torch.tensor([ids + out]), attn=attn)[0, -1].argmax())
            if nxt in tok.eos_token_ids:
                break
            out.append(nxt)
        return tok.decode(out, skip_special_tokens=True).strip()

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = {
        "none": (False, False, e4m3),
        "K e4m3": (True, False, e4m3),
        "V e4m3": (False, True, e4m3),
        "K+V e4m3": (True, True, e4m3),
        "K+V e5m2": (True, True, e5m2),
    }
    print(
        f"{path}, greedy, {len(prompts)} held-out problems: answers wrong, of which a wrong number"
    )
    print(f"{'rounded':>10}{'wrong':>7}{'number':>8}")
    for name, case in cases.items():
        said = [(answer(p.token_ids, Rounded(*case)), str(p.row["answer"])) for p in prompts]
        wrong = [a for a, truth in said if a != truth]
        numbers = sum(a.rstrip("!") != truth for a, truth in said)  # not the stray "!" habit
        print(f"{name:>10}{len(wrong):>7}{numbers:>8}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=seam.accelerator_type())
    ap.add_argument("--dtype", default="float32", help="the model's and the default pool's dtype")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192]
    )
    ap.add_argument("--seqs", type=int, default=4, help="completions generated per run")
    ap.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="the room pool; the capacity table's budget"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--formats",
        type=lambda s: s.split(","),
        default=list(FORMATS),
        help="rows of the time table, the first the reference (default,fp8,fp8/token)",
    )
    ap.add_argument(
        "--accuracy",
        nargs="?",
        const="assets/quickstart-policy",
        default=None,
        help="only a quickstart policy's held-out answers (default: the shipped one)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="2 layers, 32-token completions, 2 sequences"
    )
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.lengths, args.seqs = 2, [32], 2
    return args


def main() -> None:
    args = parse_args()
    from bench.header import print_header

    print_header("bench.fp8_kv", device=args.device)
    if args.accuracy:
        accuracy(args.accuracy)
        return
    model = build(args)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 8192, (PROMPT,), generator=g).tolist() for _ in range(args.seqs)]
    scales = calibrate(model, prompts, args.device)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, 2 KV heads of 64, {args.dtype} on "
        f"{args.device}; {args.seqs} completions after {PROMPT}-token prompts; "
        f"torch threads {torch.get_num_threads()}"
    )

    e4m3 = torch.float8_e4m3fn
    quants = {
        args.dtype: (dtype, None),
        "bfloat16": (torch.bfloat16, None),
        "fp8": (dtype, KVQuant(e4m3)),
        "fp8/token": (dtype, KVQuant(e4m3, per_token=True)),
    }
    print(f"\ncapacity: full-length sequences in {args.kv_cache_gb} GB")
    print(f"{'length':>8}" + "".join(f"{k:>12}" for k in quants) + f"{'fp8 / bf16':>12}")
    for length in args.lengths:
        caps = {
            k: capacity(model, length, args.kv_cache_gb, args.block_size, d, q)
            for k, (d, q) in quants.items()
        }
        print(
            f"{length:>8}"
            + "".join(f"{c:>12d}" for c in caps.values())
            + f"{caps['fp8'] / caps['bfloat16']:>11.2f}x"
        )

    print("\nrollout time")
    cols = (
        ("length", 8),
        ("pool", 7),
        ("kv", 11),
        ("pool GB", 9),
        ("seconds", 9),
        ("tok/s", 8),
        ("preempt", 9),
        ("ratio", 8),
    )
    print("".join(f"{name:>{w}}" for name, w in cols))
    for length in args.lengths:
        full = -(-(PROMPT + length + 1) // args.block_size) * KVCache.bytes_per_block(
            model.args, args.block_size, dtype
        )
        for pool, gb in (
            ("room", args.kv_cache_gb),
            ("tight", max(1, args.seqs // 2) * full / 1e9),
        ):
            ref = None
            for name in args.formats:
                fmt = FORMATS[name]
                dt, tokens, preempted = run(model, prompts, length, fmt, scales, gb, args)
                ref = dt if ref is None else ref
                print(
                    f"{length:>8}{pool:>7}{name:>11}{gb:>9.3f}{dt:>9.2f}{tokens / dt:>8.0f}"
                    f"{preempted:>9}{dt / ref:>7.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
