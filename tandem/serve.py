"""`tandem-serve`: an HF folder behind the OpenAI API, on Tandem's own generator, with exact ids.

    tandem-serve --model DIR [--host 127.0.0.1] [--port 8000]

The same endpoint the RL rollout serves to an agent harness (tandem/rl/generator/serve/,
docs/serving.md), for evaluation with no training: ``/v1/chat/completions`` and
``/v1/completions`` (streaming or not; ``return_token_ids``, ``prompt_token_ids``,
``logprobs``), ``/v1/models``, ``/health``,
and sessions (``/v1/sessions/<id>/...``) that keep a conversation's sampled ids and KV blocks
between turns (close one with ``POST /rl/abort``). One process: the whole model on one device.

Loopback by default; any other ``--host`` needs a bearer key (``--api-key`` or
``TANDEM_API_KEY``). Exit statuses (tandem/rl/core/errors.py): a bad flag or a port that
cannot be bound 2, an unusable model folder 4, SIGINT 130, SIGTERM 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import NoReturn

from tandem.rl.core import errors


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(
            f"error: {message} (tandem-serve --help lists the flags)", file=sys.stderr, flush=True
        )
        raise SystemExit(errors.EXIT_CONFIG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(
        prog="tandem-serve",
        description="Serve an HF folder over the OpenAI API with Tandem's generator.",
    )
    ap.add_argument(
        "--model", required=True, help="HF folder (config.json + safetensors + tokenizer)"
    )
    ap.add_argument("--tokenizer", help="tokenizer folder (default: --model)")
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to bind (not loopback: needs --api-key)"
    )
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    ap.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="bearer key every request but /health must send (default: $TANDEM_API_KEY)",
    )
    ap.add_argument(
        "--served-model-name", help="the id /v1/models lists (default: the folder's name)"
    )
    ap.add_argument(
        "--max-model-len", type=int, default=0, help="prompt + completion (0: the model's context)"
    )
    ap.add_argument("--max-tokens", type=int, default=256, help="per request, when it sets none")
    ap.add_argument(
        "--max-request-mb", type=float, default=4.0, help="larger request bodies get 413"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="sampling noise of requests that set no seed"
    )
    ap.add_argument(
        "--max-connections", type=int, default=128, help="open at once; one more gets 503"
    )
    ap.add_argument(
        "--idle-timeout-s",
        type=float,
        default=30.0,
        help="a connection with no request in flight this long is closed",
    )
    ap.add_argument(
        "--session-idle-s",
        type=float,
        default=600.0,
        help="a session with no turn this long is closed and its KV freed (0: never)",
    )
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto")
    ap.add_argument(
        "--device", choices=("auto", "cpu"), default="auto", help="auto: the accelerator if any"
    )
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: bfloat16 on CUDA, float32 elsewhere",
    )
    args = ap.parse_args(argv)
    for flag, ok in (
        ("--max-tokens", args.max_tokens >= 1),
        ("--max-model-len", args.max_model_len >= 0),
        ("--kv-cache-gb", args.kv_cache_gb > 0),
        ("--block-size", args.block_size >= 1),
        ("--max-num-seqs", args.max_num_seqs >= 1),
        ("--max-num-batched-tokens", args.max_num_batched_tokens >= 1),
        ("--session-idle-s", args.session_idle_s >= 0),
    ):
        if not ok:
            ap.error(f"{flag}: out of range, got {getattr(args, flag[2:].replace('-', '_'))}")
    from tandem.rl.generator.serve.http import ServerSettings

    problem = _settings(args, ServerSettings).check()
    if problem:
        key, _, why = problem.partition(":")
        ap.error(f"--{key.replace('_', '-')}:{why}")
    return args


def _settings(args: argparse.Namespace, cls: type) -> object:
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return cls(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_request_mb=args.max_request_mb,
        model_name=name,
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(
            "error: tandem-serve runs on one process (the whole model on one device); "
            "start it without torchrun",
            file=sys.stderr,
        )
        return errors.EXIT_CONFIG
    import torch

    from tandem.generate import check_fits, load
    from tandem.parallel.distributed import pick_device
    from tandem.rl.config.schema import ConfigError
    from tandem.rl.core.modeling import ModelSetupError
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.serve.engine import EngineSettings, ServingEngine
    from tandem.rl.generator.serve.http import AgentServer, ServerSettings
    from tandem.rl.rollout.agentic import end_of_turn_id

    device = pick_device(0, force_cpu=args.device == "cpu")
    try:
        tok, model = load(args, device)
        check_fits(
            argparse.Namespace(**{**vars(args), "max_tokens": 1}), model
        )  # the KV budget holds a block
    except ModelSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_MODEL
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_CONFIG
    context = model.args.max_position_embeddings
    max_len = min(args.max_model_len or context, context)
    gen = Generator(
        model,
        GenerationSettings(
            block_size=args.block_size,
            kv_cache_gb=args.kv_cache_gb,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            seed=args.seed,
            kernels=None if args.kernels == "auto" else args.kernels,
            cuda_graphs=args.cuda_graphs and not getattr(model.args, "num_experts", 0),
        ),
        eos_token_ids=tok.eos_token_ids,
    )
    limits = EngineSettings(
        eot_id=end_of_turn_id(tok),
        max_model_len=max_len,
        max_tokens=min(args.max_tokens, max_len - 1),
        session_idle_s=args.session_idle_s,
    )
    engine = ServingEngine(gen, tok, limits)
    server = AgentServer(_settings(args, ServerSettings), tok.vocab_size)  # type: ignore[arg-type]
    server.engine = engine
    try:
        server.start()
    except OSError as e:
        print(
            f"error: --port: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
            file=sys.stderr,
        )
        return errors.EXIT_CONFIG
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(errors.EXIT_INTERRUPTED))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(errors.EXIT_OK))
    print(
        f"serving {server.settings.model_name} at {server.url}/v1 "
        f"({'bearer key required' if args.api_key else 'no key'}; Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    with torch.inference_mode():
        engine.run(until=lambda: bool(stop))
    server.stop()
    gen.close()
    print("stopped", file=sys.stderr, flush=True)
    return stop[0] if stop else errors.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
