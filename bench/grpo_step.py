"""Seconds per GRPO step: Tandem's colocated loop vs TRL's GRPOTrainer, same workload.

One workload, two trainers, one command: a random Qwen3-style model written as an HF folder
(transformers) with the quickstart tokenizer, P prompts (chat messages, so both trainers apply
the same chat template) x n samples, up to ``--max-tokens`` new tokens at temperature 1, group
advantages with std scaling, PPO-clip (0.2), no KL (no reference model), token-mean loss, one
optimizer step per rollout, one process each. TRL runs without vLLM (transformers
``generate``); Tandem runs ``train.py`` with its own paged generator.

The settings that change the work are matched, and the bench prints them for both (a test
checks them, tests/test_benches.py): activation (gradient) checkpointing off in both, or on in
both with ``--activation-checkpoint full`` (TRL 1.16 turns it on by default); fp32 weights,
with bf16 autocast on CUDA in both (FSDP2 mixed precision for Tandem); fused AdamW with the
same lr, betas, eps, weight decay, clipping and constant schedule; the same torch threads.
The engine ``trl-default`` is TRL with its own default for gradient checkpointing: what a
TRL user gets without changing it, labelled as such and not a like-for-like row.

    python -m bench.grpo_step --trl-python-path /tmp/trl        # trl installed with --target

TRL is a test reference, not a dependency (``pip install trl``, or ``pip install --no-deps
--target DIR trl`` and ``--trl-python-path DIR``); without it only Tandem's rows print.
Each engine runs ``--steps`` steps; the first is a warm-up and is left out of the means.
``--repeats R`` runs all engines R times in turn and reports the median of the rounds'
TRL / engine ratios (a shared machine's speed drifts over minutes). Phases: ``generate``
(rollout, and for Tandem the reward calls), ``logprobs`` (no-grad forwards before the update:
Tandem recomputes the old log-probs every step; TRL skips them when generation and optimizer
steps are aligned, as here), ``update`` (the rest). Random weights rarely emit EOS, so
completions mostly run to the limit; each engine's mean completion length is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.header import print_header

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "assets", "quickstart-policy")


def write_workload(folder: str, args: argparse.Namespace) -> tuple[str, str]:
    """(model folder, prompts jsonl) for the run."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the table readable

    model_dir = os.path.join(folder, "model")
    vocab = args.vocab or json.load(open(os.path.join(TOKENIZER, "config.json")))["vocab_size"]
    if args.shape == "qwen3-1.7b":
        # Qwen3-1.7B's shapes (random weights; the char tokenizer's ids are a subset)
        shape = dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        )
    else:
        shape = dict(
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=max(1, args.hidden // 128),
            head_dim=64,
        )
    cfg = Qwen3Config(
        vocab_size=vocab,
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        # random init of a 1.7B model is minutes on a CPU, seconds on a GPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, name), model_dir)
    data = os.path.join(folder, "prompts.jsonl")
    rng = random.Random(0)
    with open(data, "w") as f:
        for i in range(args.prompts * (args.steps + 1)):
            a, b = rng.randrange(100), rng.randrange(100)
            # conversational: both trainers apply the chat template, so both see the same tokens
            prompt = [{"role": "user", "content": f"{a}+{b}="}]
            f.write(json.dumps({"id": f"p{i}", "prompt": prompt, "answer": str(a + b)}) + "\n")
    return model_dir, data


TANDEM_ROWS = {
    "tandem": (),
    "tandem-unshared": ("--advanced.share_prompts=false",),
    "tandem-eager": ("--rollout.cuda_graphs=false",),
    "tandem-exact": ("--rl.exact=true",),
    "tandem-onednn": ("--rollout.cpu_onednn=true",),
    "tandem-triton": ("--advanced.kernels=triton",),
}


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    """A trainer subprocess's environment: the thread count, and this repository ahead of
    any PYTHONPATH already set (where extra packages may live)."""
    path = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": path}


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


# ---- Tandem -------------------------------------------------------------------------


def tandem_argv(
    model_dir: str, data: str, dump: str, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> list[str]:
    """``train.py``'s arguments for the workload (the settings `trl_settings` matches)."""
    return [
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--model.path={model_dir}",
        f"--data.path={data}",
        "--data.messages_field=prompt",
        "--data.eval_path=",
        "--data.shuffle=false",
        f"--job.dump_folder={dump}",
        f"--training.steps={args.steps}",
        f"--rl.num_samples={args.samples}",
        f"--rl.prompts_per_step={args.prompts}",
        "--rl.kl_coef=0",
        "--rl.aggregation=token_mean",
        "--rl.micro_batch_tokens=16384",
        f"--rollout.max_tokens={args.max_tokens}",
        f"--rollout.kv_cache_gb={args.kv_cache_gb}",
        f"--data.max_length={args.max_tokens + 128}",
        f"--optimizer.lr={args.lr}",
        "--optimizer.betas=[0.9, 0.95]",
        "--optimizer.eps=1e-8",
        "--optimizer.weight_decay=0",
        "--optimizer.max_grad_norm=1.0",
        "--lr_schedule.warmup_steps=0",
        "--lr_schedule.decay=constant",
        f"--parallel.activation_checkpoint={args.activation_checkpoint}",
        "--training.mixed_precision_param=bfloat16",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        "--reward.functions=exact_match",
        *extra,
    ]


def run_tandem(
    model_dir: str,
    data: str,
    folder: str,
    args: argparse.Namespace,
    name: str,
    extra: tuple[str, ...] = (),
) -> dict[str, float]:
    dump = os.path.join(folder, name)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *tandem_argv(model_dir, data, dump, args, extra),
    ]
    env = _child_env(args)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tandem run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    # drop the warm-up step
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))][1:]
    step = [x["time/step_s"] for x in rows]
    gen = [x["time/rollout_s"] for x in rows]
    logp = [x["time/logprobs_s"] for x in rows]
    return {
        "step_s": _mean(step),
        "generate_s": _mean(gen),
        "logprobs_s": _mean(logp),
        "update_s": _mean(step) - _mean(gen) - _mean(logp),
        "completion_len": _mean([x["response/length_mean"] for x in rows]),
    }


# ---- TRL (worker mode, in the interpreter that has trl) ------------------------------


def trl_settings(
    args: argparse.Namespace, folder: str, default_checkpointing: bool = False
) -> dict:
    """``GRPOConfig``'s arguments for the workload, matched to `tandem_argv` (the test in
    tests/test_benches.py checks the match); ``default_checkpointing``: leave gradient
    checkpointing at TRL's default (the ``trl-default`` row)."""
    import torch

    cuda = (
        args.device == "cuda"
    )  # CUDA: fp32 weights, bf16 autocast (as Tandem's FSDP2 mixed precision)
    kw = dict(
        output_dir=os.path.join(folder, "trl"),
        use_cpu=not cuda,
        bf16=cuda,
        fp16=False,
        report_to="none",
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
        max_steps=args.steps,
        logging_steps=1,
        seed=0,
        per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        num_generations=args.samples,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",
        optim="adamw_torch_fused",
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        use_vllm=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        log_completions=False,
        disable_dropout=True,
        gradient_checkpointing=args.activation_checkpoint != "none",
    )
    if default_checkpointing:
        del kw["gradient_checkpointing"]
    return kw


def trl_resolved(config, model=None) -> dict:  # noqa: ANN001 - a GRPOConfig, the trainer's model
    """The settings `tandem_settings` lists, as TRL resolved them: from the config, or where
    ``model`` is given (the worker, after training) checkpointing and dtype from the model;
    the worker also replaces the optimizer's name with the one the trainer built."""
    dtype = config.model_init_kwargs["dtype"] if model is None else next(model.parameters()).dtype
    ckpt = config.gradient_checkpointing if model is None else model.is_gradient_checkpointing
    return {
        "checkpointing": bool(ckpt),
        "dtype": str(dtype).removeprefix("torch."),
        "autocast_bf16": bool(config.bf16),
        "optimizer": getattr(config.optim, "value", config.optim),
        "lr": config.learning_rate,
        "betas": [config.adam_beta1, config.adam_beta2],
        "eps": config.adam_epsilon,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "schedule": getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type),
        "warmup_steps": config.warmup_steps,
    }


def trl_worker(
    model_dir: str, data: str, folder: str, args: argparse.Namespace
) -> dict[str, float]:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)

    def exact_match(completions: list[list[dict]], answer: list[str], **_: object) -> list[float]:
        # conversational prompts: each completion is [{"role": "assistant", "content": ...}]
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    config = GRPOConfig(**trl_settings(args, folder, default_checkpointing=args.trl_default))
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[exact_match],
        args=config,
        train_dataset=load_dataset("json", data_files=data, split="train"),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    timers = {"generate": 0.0, "logprobs": 0.0}

    def timed(name: str, fn, only_no_grad: bool = False):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            timers[name] += time.perf_counter() - t0
            return out

        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, True
    )
    steps: list[dict[str, float]] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            timers.update(generate=0.0, logprobs=0.0, t0=time.perf_counter())

        def on_step_end(self, *_: object, **__: object) -> None:
            steps.append(
                {
                    "step_s": time.perf_counter() - timers["t0"],
                    "generate_s": timers["generate"],
                    "logprobs_s": timers["logprobs"],
                }
            )

        def on_log(
            self,
            _args: object,
            _state: object,
            _control: object,
            logs: dict | None = None,
            **__: object,
        ) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(Clock())
    trainer.train()
    settings = trl_resolved(
        config, trainer.model
    )  # after train(): the trainer turns checkpointing on there
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    fused = type(opt).__name__ == "AdamW" and bool(opt.defaults.get("fused"))
    settings["optimizer"] = "adamw_torch_fused" if fused else f"{type(opt).__name__} (not fused)"
    rows = steps[1:]  # drop the warm-up step
    step = _mean([x["step_s"] for x in rows])
    gen, logp = _mean([x["generate_s"] for x in rows]), _mean([x["logprobs_s"] for x in rows])
    return {
        "step_s": step,
        "generate_s": gen,
        "logprobs_s": logp,
        "update_s": step - gen - logp,
        "completion_len": _mean(lengths[1:]),
        "settings": settings,
    }


def run_trl(
    model_dir: str,
    data: str,
    folder: str,
    args: argparse.Namespace,
    default_checkpointing: bool = False,
) -> dict | str:
    python = args.trl_python or sys.executable
    env = _child_env(args)
    if args.trl_python_path:
        env["PYTHONPATH"] += os.pathsep + args.trl_python_path
    probe = subprocess.run([python, "-c", "import trl"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"trl is not importable by {python} (see this file's docstring)"
    cmd = [python, "-m", "bench.grpo_step", "--worker", model_dir, data, folder, *args.argv]
    r = subprocess.run(
        cmd + (["--trl-default"] if default_checkpointing else []),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return f"trl run failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def tandem_settings(cfg, device: str) -> dict:  # noqa: ANN001 - a tandem.rl.config Config
    """The settings `trl_settings` must match, as Tandem's loaded config sets them (its AdamW
    is always fused: tandem.rl.core.optim.build_optimizer; weights fp32, autocast on CUDA)."""
    o = cfg.optimizer
    return {
        "checkpointing": cfg.parallel.activation_checkpoint != "none",
        "dtype": "float32",
        "autocast_bf16": device == "cuda" and cfg.training.mixed_precision_param == "bfloat16",
        "optimizer": "adamw_torch_fused",
        "lr": o.lr,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.max_grad_norm,
        "schedule": cfg.lr_schedule.decay,
        "warmup_steps": cfg.lr_schedule.warmup_steps,
    }


def _tandem_config(model_dir: str, data: str, folder: str, args: argparse.Namespace):  # noqa: ANN202
    from tandem.rl.config.schema import parse_args as parse_train_args

    return parse_train_args(tandem_argv(model_dir, data, os.path.join(folder, "settings"), args))[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (the group)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="steps per engine; the first is a warm-up")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all engines, alternating; the ratio is "
        "the median of the rounds' TRL / "
        "engine ratios",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument(
        "--device",
        default=None,
        choices=("cpu", "cuda"),
        help="default: cuda when available (Tandem picks the device itself; TRL follows this)",
    )
    ap.add_argument(
        "--shape",
        default="small",
        choices=("small", "qwen3-1.7b"),
        help="small: --hidden x --layers; qwen3-1.7b: Qwen3-1.7B's shapes",
    )
    ap.add_argument(
        "--vocab", type=int, default=0, help="model vocabulary (default: the tokenizer's)"
    )
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="Tandem's KV pool budget")
    ap.add_argument(
        "--activation-checkpoint",
        default="none",
        choices=("none", "full"),
        help="in both trainers: Tandem's parallel.activation_checkpoint, TRL's "
        "gradient_checkpointing",
    )
    ap.add_argument(
        "--trl-python", default=None, help="interpreter that has trl (default: this one)"
    )
    ap.add_argument(
        "--trl-python-path",
        default=None,
        help="a folder with trl, added to the TRL worker's PYTHONPATH",
    )
    ap.add_argument(
        "--engines",
        default="tandem,trl",
        help="tandem-unshared: advanced.share_prompts = false (each sample packs "
        "its own prompt copy); "
        "tandem-eager: rollout.cuda_graphs = false (CUDA; the same as tandem "
        "elsewhere); tandem-exact: rl.exact = true (batch-invariant kernels); "
        "tandem-onednn: rollout.cpu_onednn = true (CPU); "
        "tandem-triton: advanced.kernels = triton (every kernel's Triton form); "
        "trl-default: TRL with its "
        "default gradient checkpointing (on in TRL 1.16: not like for like)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="the smallest workload (the test suite's run)"
    )
    # internal: TRL worker mode
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--trl-default", action="store_true", help=argparse.SUPPRESS
    )  # internal: the trl-default row
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.prompts, args.samples, args.max_tokens, args.steps, args.hidden, args.layers = (
            2,
            2,
            4,
            2,
            64,
            1,
        )
    unknown = [e for e in args.engines.split(",") if e not in TRL_ROWS and e not in TANDEM_ROWS]
    if unknown:
        ap.error(f"--engines: unknown {unknown}; choose from {[*TRL_ROWS, *TANDEM_ROWS]}")
    return args


TRL_ROWS = ("trl", "trl-default")


def run_engine(
    engine: str, model_dir: str, data: str, folder: str, args: argparse.Namespace, rnd: int
) -> dict | str:
    if engine in TRL_ROWS:
        return run_trl(model_dir, data, folder, args, default_checkpointing=engine == "trl-default")
    return run_tandem(model_dir, data, folder, args, f"{engine}-{rnd}", TANDEM_ROWS[engine])


def print_ratios(rounds: list[dict[str, dict]], engines: list[str]) -> None:
    """Median over the rounds of seconds per step, each TRL row over each Tandem row, then each
    other Tandem row over the first (e.g. tandem-exact / tandem): a cost measured in one command."""
    ours = [e for e in engines if e in TANDEM_ROWS]
    pairs = [(ref, e) for ref in engines if ref in TRL_ROWS for e in ours]
    pairs += [(e, ours[0]) for e in ours[1:]]
    for ref, engine in pairs:
        ratios = [
            rr[ref]["step_s"] / rr[engine]["step_s"] for rr in rounds if ref in rr and engine in rr
        ]
        if ratios:
            each = ", ".join(f"{x:.2f}" for x in ratios)
            print(
                f"{ref} / {engine} seconds per step: median {statistics.median(ratios):.2f}x "
                f"(rounds: {each})"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device is None:
        from tandem import device as seam

        args.device = seam.accelerator_type()
    if args.worker:
        print(json.dumps(trl_worker(*args.worker, args)))
        return
    print_header("bench.grpo_step", args.argv, args.device)
    folder = tempfile.mkdtemp(prefix="tandem-grpo-bench-")
    try:
        model_dir, data = write_workload(folder, args)
        ours = tandem_settings(_tandem_config(model_dir, data, folder, args), args.device)
        what = (
            "Qwen3-1.7B shapes"
            if args.shape == "qwen3-1.7b"
            else f"Qwen3 hidden {args.hidden} x {args.layers} layers"
        )
        where = "CUDA" if args.device == "cuda" else f"CPU, {args.threads} threads"
        print(
            f"{args.prompts} prompts x {args.samples} samples, <= {args.max_tokens} new "
            f"tokens, {what}, {where}, mean of steps 2..{args.steps}"
        )
        print("settings, both trainers: " + ", ".join(f"{k} {v}" for k, v in ours.items()))
        print(
            f"{'engine':<15}{'round':>6}{'step s':>9}{'generate':>10}{'logprobs':>10}"
            f"{'update':>9}{'compl len':>11}"
        )
        rounds: list[dict[str, dict]] = []
        for rnd in range(1, args.repeats + 1):
            # engines alternate, so a slow spell of the machine hits all of them
            results: dict[str, dict] = {}
            for engine in args.engines.split(","):
                r = run_engine(engine, model_dir, data, folder, args, rnd)
                if isinstance(r, str):
                    print(f"{engine:<15} {r}")
                    continue
                results[engine] = r
                print(
                    f"{engine:<15}{rnd:>6}{r['step_s']:>9.2f}{r['generate_s']:>10.2f}"
                    f"{r['logprobs_s']:>10.2f}{r['update_s']:>9.2f}{r['completion_len']:>11.1f}",
                    flush=True,
                )
                theirs = r.get("settings", {})
                differ = {k: v for k, v in theirs.items() if ours.get(k) != v}
                if differ:  # only the trl-default row may differ (its gradient checkpointing)
                    print(f"{'':<15} settings differ from Tandem's (not like for like): {differ}")
            rounds.append(results)
        print_ratios(rounds, args.engines.split(","))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
