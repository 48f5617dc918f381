"""Offline generation with the in-house generator: jsonl prompts in, jsonl completions out.

    tandem-generate --model DIR --input prompts.jsonl --output out.jsonl --n 4
    torchrun --nproc-per-node 8 -m tandem.generate --model DIR --input ... --output ... \\
        --num-samples 4

(Under torchrun write ``--num-samples``: torchrun reads ``--n`` as an
ambiguous abbreviation of its own flags.)

Input rows are ``{"prompt": "text"}`` (encoded as is, unless --chat-template
wraps it as one user turn) or ``{"messages": [{"role": ..., "content": ...}]}``
(the folder's chat template applied with the generation prompt); an ``id``
field is carried over. With a vision-language model (Qwen2.5-VL) a message's
content may be a list of ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": PATH or data: URI}`` parts (relative paths are read
from the input file's folder), as in training data (tandem/rl/data/images.py). Each output row is
one sample: ``index`` (input line, 0-based), ``id``, ``sample``, ``prompt_tokens``, ``text``,
``token_ids``, ``logprobs`` (the raw model's, temperature 1, no truncation: what RL uses),
``sampling_logprobs`` (under the distribution sampled from) and
``finish_reason``.

Every prompt's randomness comes from ``--seed + its line index`` (and the
sample index), so the output is the same however many ranks share the work:
under torchrun each rank takes every world-size-th prompt and rank 0 writes
the file, in input order. The output is written to a temporary file and
renamed at the end, so a failed or interrupted run leaves no partial file.

Every problem is one line on stderr and an exit status (tandem/rl/core/errors.py):
a bad flag value 2 (checked before the model loads; the KV budget and
``--max-tokens`` against the model right after), a bad input line 3 naming it
(a prompt that does not fit the model's context with ``--max-tokens`` is one,
unless ``--truncate-prompts`` keeps its last tokens), an unusable model folder
4, Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from tandem import device as seam
from tandem.rl.config.schema import ConfigError, check_writable_folder
from tandem.rl.core import errors
from tandem.rl.core.fields import get_field
from tandem.rl.core.modeling import ModelSetupError
from tandem.rl.data.images import VisionData, prepare_messages, with_images
from tandem.rl.data.loading import DataError, iter_jsonl_objects, message_problem
from tandem.rl.generator.engine import GenerationSettings, Generator, stop_strings_check
from tandem.rl.generator.sequence import SamplingParams


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not the usage text."""

    def error(self, message: str) -> NoReturn:
        print(
            f"error: {message} (tandem-generate --help lists the flags)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(errors.EXIT_CONFIG)


def _flag_problem(args: argparse.Namespace) -> str | None:
    """The first flag value the generator would fail on later, as one line; None when
    all are fine."""
    finite = {
        "--temperature": args.temperature,
        "--top-p": args.top_p,
        "--min-p": args.min_p,
        "--kv-cache-gb": args.kv_cache_gb,
    }
    checks = [
        *((f"{k}: must be a finite number, got {v}", math.isfinite(v)) for k, v in finite.items()),
        (f"--n: must be >= 1, got {args.n}", args.n >= 1),
        (f"--max-tokens: must be >= 1, got {args.max_tokens}", args.max_tokens >= 1),
        (
            f"--temperature: must be >= 0 (0 = greedy), got {args.temperature}",
            args.temperature >= 0,
        ),
        (f"--top-k: must be >= 0 (0 = off), got {args.top_k}", args.top_k >= 0),
        (f"--top-p: must be in (0, 1] (1 = off), got {args.top_p}", 0 < args.top_p <= 1),
        (f"--min-p: must be in [0, 1] (0 = off), got {args.min_p}", 0 <= args.min_p <= 1),
        (f"--seed: must be in [0, 2**32), got {args.seed}", 0 <= args.seed < 2**32),
        (f"--stop: stop strings must not be empty, got {args.stop}", all(args.stop)),
        (f"--kv-cache-gb: must be > 0, got {args.kv_cache_gb}", args.kv_cache_gb > 0),
        (f"--block-size: must be >= 1, got {args.block_size}", args.block_size >= 1),
        (f"--max-num-seqs: must be >= 1, got {args.max_num_seqs}", args.max_num_seqs >= 1),
        (
            f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}",
            args.max_num_batched_tokens >= 1,
        ),
        (f"--output: {args.output} is a folder; give a file path", not os.path.isdir(args.output)),
    ]
    for message, ok in checks:
        if not ok:
            return message
    try:
        check_writable_folder("--output", os.path.dirname(os.path.abspath(args.output)))
    except ConfigError as e:
        return str(e)
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(
        prog="tandem-generate", description="Generate completions with Tandem's paged-KV generator."
    )
    ap.add_argument("--model", required=True, help="HF folder (config.json + safetensors)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: --model)")
    ap.add_argument("--input", required=True, help="jsonl of prompt rows")
    ap.add_argument("--output", required=True, help="jsonl to write, one row per sample")
    ap.add_argument(
        "--n",
        "--num-samples",
        dest="n",
        type=int,
        default=1,
        help="samples per prompt (spell it --num-samples under torchrun, whose own "
        "flags --n abbreviates)",
    )
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument(
        "--chat-template", action="store_true", help="wrap text prompts as one user turn"
    )
    ap.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="keep the last tokens of a prompt that does not fit the model's context "
        "with --max-tokens (default: such a prompt is an error naming its "
        "line, exit 3)",
    )
    ap.add_argument(
        "--text-field", default="prompt", help="a key, or a dotted path (extra_info.question)"
    )
    ap.add_argument("--messages-field", default="messages", help="a key, or a dotted path")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto")
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay CUDA graphs for decode steps (CUDA only; eager elsewhere)",
    )
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: bfloat16 on CUDA, float32 elsewhere",
    )
    args = ap.parse_args(argv)
    if (problem := _flag_problem(args)) is not None:
        ap.error(problem)
    return args


def read_prompts(path: str, text_field: str, messages_field: str) -> list[dict[str, Any]]:
    """Validated rows: {"id", "text"} or {"id", "messages"}; DataError names the line."""
    rows = []
    for where, row in iter_jsonl_objects(path):
        # a top-level key or a dotted path into nested columns, as training's *_field settings
        msgs, text = get_field(row, messages_field), get_field(row, text_field)
        if msgs is not None:
            if message_problem(msgs) is not None:
                raise DataError(
                    f"{where}: {messages_field!r} must be a non-empty list of "
                    '{"role": str, "content": str or a list of text / image '
                    "parts} objects "
                    f"({message_problem(msgs)})"
                )
            rows.append({"id": row.get("id"), "messages": msgs, "where": where})
        elif text is not None:
            if not isinstance(text, str) or not text:
                raise DataError(f"{where}: {text_field!r} must be a non-empty string")
            rows.append({"id": row.get("id"), "text": text, "where": where})
        else:
            raise DataError(f"{where}: has neither {text_field!r} nor {messages_field!r}")
    if not rows:
        raise DataError(f"{path}: no prompt rows")
    return rows


def encode(
    row: dict[str, Any], tok: Any, chat: bool, vision: VisionData | None = None
) -> tuple[list[int], Any]:
    """(token ids, the prompt's PromptImages or None); DataError names the line of a bad image."""
    if "messages" in row or chat:
        if tok.chat_template is None:
            raise DataError(
                "the tokenizer has no chat template; give text prompts without --chat-template"
            )
        try:
            msgs = prepare_messages(
                row.get("messages") or [{"role": "user", "content": row["text"]}], vision
            )
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
            return with_images(msgs, tok.encode(text), vision)[:2]
        except ValueError as e:
            raise DataError(f"{row['where']}: {e}") from None
    return tok.encode(row["text"]), None


def load(args: argparse.Namespace, device: torch.device):
    from tandem.models.hf import load_model
    from tandem.models.tokenizer import Tokenizer

    dtype = {
        "auto": torch.bfloat16 if seam.capabilities(device).mixed_precision else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    try:
        tok = Tokenizer.from_dir(args.tokenizer or args.model)
        model = load_model(args.model, device=device, dtype=dtype).eval()
    except (OSError, ValueError, KeyError) as e:
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise ModelSetupError(
            f"--model {args.model}: "
            f"{text.strip().splitlines()[0] if text.strip() else type(e).__name__}"
        ) from None
    return tok, model


def check_fits(args: argparse.Namespace, model: Any) -> None:
    """Settings that need the model: ConfigError (exit 2) for a KV budget below one block
    or a --max-tokens that leaves no room for a prompt in the context."""
    from tandem.rl.generator.kv_cache import KVCache

    dtype = next(model.parameters()).dtype
    per_block = KVCache.bytes_per_block(model.args, args.block_size, dtype)
    if args.kv_cache_gb * 1e9 < per_block:
        raise ConfigError(
            f"--kv-cache-gb: {args.kv_cache_gb} GB holds no KV block of this model "
            f"(one block of {args.block_size} tokens takes {per_block / 1e9:.3g} GB "
            f"in {str(dtype).removeprefix('torch.')})"
        )
    context = model.args.max_position_embeddings
    if args.max_tokens >= context:
        raise ConfigError(
            f"--max-tokens: {args.max_tokens} leaves no room for a prompt in the "
            f"model's context of {context} tokens (max_position_embeddings in "
            "config.json)"
        )


def fit_prompt(
    ids: list[int], row: dict[str, Any], args: argparse.Namespace, context: int
) -> list[int]:
    """``ids``, or their last tokens under --truncate-prompts, so that prompt + --max-tokens fit
    ``context``; DataError naming the line otherwise."""
    room = context - args.max_tokens
    if len(ids) <= room:
        return ids
    if not args.truncate_prompts or row.get("images") is not None:
        fix = (
            "(a prompt with images is never cut)"
            if row.get("images") is not None
            else "or pass --truncate-prompts"
        )
        raise DataError(
            f"{row['where']}: prompt of {len(ids)} tokens + --max-tokens "
            f"{args.max_tokens} exceeds the model's context of {context} tokens; "
            f"shorten it, lower --max-tokens {fix}"
        )
    return ids[-room:]


def generate_rows(
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    prompts: list[tuple[int, dict[str, Any]]],
    announce: str = "",
) -> tuple[list[dict[str, Any]], int]:
    """This rank's ``prompts`` (index, row), checked, then sampled: one row per sample, and
    the tokens generated. ``announce`` (the main rank: "N prompts"): a line on stderr once every
    prompt is checked and sampling starts."""
    context = model.args.max_position_embeddings
    vision = VisionData.for_model(model.args, args.input)
    ids, images = [], []
    for _, row in prompts:
        prompt_ids, row["images"] = encode(row, tok, args.chat_template, vision)
        ids.append(fit_prompt(prompt_ids, row, args, context))  # a prompt with images is never cut
        images.append(row["images"])
    settings = GenerationSettings(
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(map(len, ids), default=0) + args.max_tokens + 1,
        kernels=None if args.kernels == "auto" else args.kernels,
        seed=args.seed,
        cuda_graphs=args.cuda_graphs,
    )
    gen = Generator(model, settings, eos_token_ids=tok.eos_token_ids)
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            seed=(args.seed + index) * 1_000_003,
        )
        for index, _ in prompts
    ]
    check = stop_strings_check(tok.decode, args.stop) if args.stop else None
    if announce:
        print(f"generating {announce} x {args.n} samples", file=sys.stderr, flush=True)
    out = gen.generate(ids, params, n=args.n, stop_check=check, images=images) if prompts else []
    gen.close()
    rows, generated = [], 0
    for (index, row), prompt_ids, comps in zip(prompts, ids, out):
        for c in comps:
            generated += len(c.token_ids)
            rows.append(
                {
                    "index": index,
                    "id": row["id"],
                    "sample": c.sample_index,
                    "prompt_tokens": len(prompt_ids),
                    "text": tok.decode(c.token_ids, skip_special_tokens=True),
                    "token_ids": c.token_ids,
                    "logprobs": c.raw_logprobs,
                    "sampling_logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
    return rows, generated


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tandem.parallel.distributed import destroy_distributed, init_distributed
    from tandem.rl.core.system import tune_host_allocator

    tune_host_allocator()

    info = init_distributed()
    status = None
    try:
        status = _run(args, info)
        return status
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT); no output written", file=sys.stderr, flush=True)
        status = errors.EXIT_INTERRUPTED
        return status
    finally:
        destroy_distributed(barrier=status == errors.EXIT_OK)


def _run(args: argparse.Namespace, info: Any) -> int:
    t0 = time.monotonic()
    try:
        prompts = read_prompts(args.input, args.text_field, args.messages_field)
        tok, model = load(args, info.device)
        check_fits(args, model)
        mine = [(i, prompts[i]) for i in range(info.rank, len(prompts), info.world_size)]
        rows, generated = generate_rows(
            args, model, tok, mine, announce=f"{len(prompts)} prompts" if info.is_main else ""
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_CONFIG
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_DATA
    except ModelSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_MODEL
    counts = torch.tensor([generated], dtype=torch.float64)
    if info.world_size > 1:
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
        dist.all_reduce(counts)
    if info.is_main:
        rows.sort(key=lambda r: (r["index"], r["sample"]))
        tmp = f"{args.output}.partial-{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
            os.replace(tmp, args.output)
        finally:  # a failed or interrupted write leaves nothing behind
            if os.path.exists(tmp):
                os.remove(tmp)
        dt = time.monotonic() - t0
        print(
            f"generated {len(prompts)} prompts x {args.n} samples = {len(rows)} rows, "
            f"{int(counts.item())} tokens in {dt:.1f}s ({counts.item() / max(dt, 1e-9):.1f} "
            f"tokens/s) -> {args.output}",
            file=sys.stderr,
        )
    return errors.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
