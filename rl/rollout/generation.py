"""The rollout phase: gather the policy into a generation copy, sample, score.

The generation copy is a plain (unsharded) `Transformer` built from the
policy gathered over FSDP2, TP and pipeline stages; it lives only for the rollout
and is dropped before the update phase, as is the KV pool the generator
carves from its budget. Both sizes and the gather time are reported.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import batch_invariant
from kernels.cpu_linear import onednn_linear_available, use_onednn_linears
from models.args import ModelArgs
from models.transformer import Transformer
from rl.data.prompts import Prompt
from rl.generator.engine import GenerationSettings, Generator, stop_strings_check
from rl.generator.sequence import SamplingParams
from rl.rollout.types import RolloutSample


def build_generation_model(policy: Any, args: ModelArgs, device: torch.device,
                           dtype: torch.dtype | None = None, *, layout: bool = True,
                           ) -> tuple[Transformer, dict[str, float]]:
    """Collective: every rank gets a full, unsharded copy of the policy for generation.

    ``policy``: an rl/update/policy.py policy, whose ``full_state()`` gathers the whole
    state dict onto every rank (over FSDP2, TP and the pipeline stages).
    ``dtype``: cast the copy's floating-point tensors to it (None keeps the parameters' dtype).
    ``layout``: the copy gets `inference_layout` (False: the training layout, for tests).
    """
    t0 = time.monotonic()
    full = policy.full_state()
    if dtype is not None:  # one tensor at a time, so the full-precision copy is freed as it goes
        for k, v in full.items():
            if v.is_floating_point():
                full[k] = v.to(dtype)
    nbytes = sum(t.numel() * t.element_size() for k, t in full.items() if k != "output.weight" or not args.tie_word_embeddings)
    with torch.device("meta"):
        gen = Transformer(args)
    gen.load_state_dict(full, assign=True, strict=True)
    gen.tie_weights()
    gen.rope.to_empty(device=device)  # materialise and recompute the RoPE table
    gen.requires_grad_(False).eval()
    if layout:
        inference_layout(gen)
    return gen, {"reshard/seconds": time.monotonic() - t0, "reshard/gb": nbytes / 1e9}


def inference_layout(model: Transformer) -> bool:
    """The rollout copy's layout, in place; returns whether it changed anything.

    On CUDA: the q/k/v and gate/up projections fused into one product each
    (`Transformer.fuse_projections`); the generator ran 3-6 % faster on an H200 with the
    same tokens (bench.generate, hidden 1024 x 16 layers, bf16, CUDA graphs). On the CPU in
    fp32, where PyTorch has oneDNN: fused too, and every linear run through oneDNN on a
    prepacked weight (`kernels.cpu_linear`); a rollout of the GRPO bench's shape took 550 ->
    453 ms with the fusion on oneDNN, then 471 -> 403 ms with prepacking. Elsewhere (CPU
    without oneDNN or in another dtype) the layout stays, as nothing was measured there.
    Numbers: docs/performance.md."""
    weight = next(model.parameters(), None)
    if weight is None or batch_invariant.enabled():  # rl.exact: the update's own (unfused, aten) linears
        return False
    if weight.is_cuda:
        model.fuse_projections()
        return True
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_linear_available():
        return False
    model.fuse_projections()
    use_onednn_linears(model)
    return True


def generation_dtype(setting: str, device: torch.device, mixed_precision_param: str) -> torch.dtype | None:
    """The generation copy's dtype for ``rollout.dtype`` (None: keep the parameters' dtype).

    ``auto`` generates in the update's compute dtype where the update uses one (FSDP2 mixed
    precision applies on CUDA only), so rollout and update see the same rounding.
    """
    if setting == "auto":
        return getattr(torch, mixed_precision_param) if device.type == "cuda" else None
    return getattr(torch, setting)


def generation_settings(rcfg: Any, max_prompt_tokens: int, seed: int) -> GenerationSettings:
    return GenerationSettings(
        block_size=rcfg.block_size, num_blocks=rcfg.num_blocks, kv_cache_gb=rcfg.kv_cache_gb,
        max_num_seqs=rcfg.max_num_seqs, max_num_batched_tokens=rcfg.max_num_batched_tokens,
        prefix_sharing=rcfg.prefix_sharing, max_model_len=max_prompt_tokens + rcfg.max_tokens + 1,
        kernels=None if rcfg.kernels == "auto" else rcfg.kernels, seed=seed, cuda_graphs=rcfg.cuda_graphs,
    )


def sampling_params(rcfg: Any, *, greedy: bool = False) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=rcfg.max_tokens)
    return SamplingParams(temperature=rcfg.temperature, top_k=rcfg.top_k, top_p=rcfg.top_p, min_p=rcfg.min_p,
                          max_tokens=rcfg.max_tokens)


def _with_generator(gen_model: Transformer, tokenizer: Any, settings: GenerationSettings, num_seqs: int,
                    run: Callable[[Generator], Any]) -> tuple[Any, dict[str, float]]:
    """``run(generator)`` on a generator whose KV pool is sized for ``num_seqs`` sequences and
    freed on return (a leak raises); the rollout/* metrics of that generation."""
    t0 = time.monotonic()
    settings.max_num_seqs = min(settings.max_num_seqs, max(1, num_seqs))  # sizes the KV pool too
    gen = Generator(gen_model, settings, eos_token_ids=tokenizer.eos_token_ids)
    out = run(gen)
    if not gen.pool_is_free():
        raise RuntimeError("generator leaked KV blocks")
    stats, kv_bytes = gen.stats, gen.cache.nbytes
    gen.close()
    dt = time.monotonic() - t0
    return out, {"rollout/seconds": dt, "rollout/tokens_per_s": stats.generated_tokens / max(dt, 1e-9),
                 "rollout/generated_tokens": float(stats.generated_tokens),
                 "rollout/preemptions": float(stats.preemptions), "rollout/kv_cache_gb": kv_bytes / 1e9}


def generate_samples(gen_model: Transformer, tokenizer: Any, prompts: list[Prompt], n: int, rcfg: Any, *,
                     seed: int, max_prompt_tokens: int, greedy: bool = False,
                     seeds: list[int] | None = None) -> tuple[list[RolloutSample], dict[str, float]]:
    """n completions per prompt with the in-house generator; the KV pool is freed on return.

    ``seeds``: one per prompt (its samples use seed + sample index), so a sample's noise does
    not depend on which other prompts share the generator; None derives them from ``seed``
    and the batch slot."""
    check = stop_strings_check(tokenizer.decode, rcfg.stop) if rcfg.stop else None
    base = sampling_params(rcfg, greedy=greedy)
    params = base if seeds is None else [dataclasses.replace(base, seed=s) for s in seeds]
    out, metrics = _with_generator(
        gen_model, tokenizer, generation_settings(rcfg, max_prompt_tokens, seed), len(prompts) * n,
        lambda gen: gen.generate([p.token_ids for p in prompts], params, n=n, stop_check=check))
    samples = []
    for group, (p, comps) in enumerate(zip(prompts, out)):
        for c in comps:
            lp = iter(c.raw_logprobs)
            gen_lp = [next(lp) if m else 0.0 for m in c.sampled_mask]
            samples.append(RolloutSample(group=group, prompt_ids=p.token_ids, completion_ids=c.token_ids,
                                         loss_mask=c.sampled_mask, gen_logprobs=gen_lp,
                                         finish_reason=c.finish_reason,
                                         text=tokenizer.decode(c.token_ids, skip_special_tokens=True), row=p.row))
    return samples, metrics


def generate_episodes(gen_model: Transformer, tokenizer: Any, prompts: list[Prompt], n: int, rcfg: Any, ecfg: Any,
                      pool: Any, *, seed: int, greedy: bool = False,
                      seeds: list[int] | None = None) -> tuple[list[RolloutSample], dict[str, float]]:
    """n multi-turn episodes per prompt against ``ecfg.name`` (rl/rollout/agentic.py); the KV pool is freed on return."""
    from rl.rollout.agentic import run_agentic_rollout

    settings = generation_settings(rcfg, ecfg.max_total_tokens - rcfg.max_tokens, seed)  # max_model_len: the episode cap
    (samples, env_metrics), metrics = _with_generator(
        gen_model, tokenizer, settings, len(prompts) * n,
        lambda gen: run_agentic_rollout(gen, tokenizer, ecfg.name, ecfg.kwargs, [p.row for p in prompts], n,
                                        sampling_params(rcfg, greedy=greedy), max_turns=ecfg.max_turns,
                                        max_total_tokens=ecfg.max_total_tokens, pool=pool,
                                        max_turn_tokens=ecfg.max_turn_tokens, seeds=seeds))
    return samples, {**env_metrics, **metrics}
