"""The rollout's sampling: the policy's generation copy, and completions or episodes from it.

`generation_copy` resolves ``rollout.tp`` and builds the policy's `GenerationCopy`
(tandem/parallel/generation_layout.py); `sample_completions` and `sample_episodes` run a
generator on that copy, its KV pool freed on return, and report the rollout/* metrics. In a
generation group (``rollout.tp > 1``) the ranks pool their prompts and run one generator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tandem import device as seam
from tandem.kernels.weight_quant import FORMATS as WEIGHT_FORMATS
from tandem.models.args import ModelArgs
from tandem.models.lora import lora_spec_of
from tandem.models.transformer import Transformer
from tandem.parallel.ac import clean_fqn
from tandem.parallel.generation_layout import (
    GenerationCopy,
    GenerationLayout,
    auto_tp,
    check_divisible,
    make_layout,
    shard_bytes,
)
from tandem.parallel.reshard import held
from tandem.rl.data.prompts import Prompt
from tandem.rl.fault.inject import forced_length, generator_delay
from tandem.rl.generator.engine import GenerationSettings, Generator, stop_strings_check
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample


def resident_bytes(
    param_bytes: float,
    head_bytes: float,
    *,
    offload_optimizer: bool = False,
    reference: bool = False,
    critic: bool = False,
    trained_bytes: float | None = None,
) -> float:
    """What the update keeps on a device through the rollout: the policy's fp32 parameter shards
    there (``param_bytes``, of which its LM head's ``head_bytes``, and of which ``trained_bytes``
    are trained: all but a LoRA base, None: all) with AdamW's two moments of the trained ones
    unless ``rl.offload_optimizer``, a frozen reference copy (``reference``), and a critic (the
    policy less its head) with its moments. The run and the planner count it this one way."""
    trained = param_bytes if trained_bytes is None else trained_bytes
    optimizer = 0 if offload_optimizer else 2 * trained
    critic_bytes = 3 * (param_bytes - head_bytes) if critic else 0
    return param_bytes + optimizer + (param_bytes if reference else 0) + critic_bytes


def choose_rollout_tp(
    tp: int,
    rcfg: Any,
    args: ModelArgs,
    dtype: torch.dtype,
    *,
    world: int,
    devices_per_node: int,
    device_bytes: float | None,
    resident: float,
) -> int:
    """``tp`` (``rollout.tp``), 0 (auto) resolved by `auto_tp` on a device of ``device_bytes``
    (None: not CUDA, where auto is 1) beside ``resident`` bytes (`resident_bytes`, the busiest
    rank's)."""
    if tp or device_bytes is None:
        return tp or 1
    layout = partial(GenerationLayout, vocab_parallel=rcfg.vocab_parallel)
    return auto_tp(
        args,
        lambda g: shard_bytes(args, layout(tp=g), dtype),
        world=world,
        devices_per_node=devices_per_node,
        device_bytes=device_bytes,
        resident_bytes=resident,
        kv_bytes=rcfg.kv_cache_gb * 1e9,
    )


def rank_resident_bytes(policy: Any, device: torch.device, **flags: bool) -> float:
    """Collective: `resident_bytes` of the busiest rank, from the policy's shards on ``device``
    (``flags``: its offload_optimizer, reference and critic)."""
    mine = [
        (clean_fqn(n), held(p.detach())[0], p.requires_grad)
        for n, p in policy.state_module.named_parameters()
    ]
    here = [(n, t.numel() * 4, g) for n, t, g in mine if t.device == device]  # fp32 master shards
    params, head = sum(b for _, b, _ in here), sum(b for n, b, _ in here if n.startswith("output."))
    trained = sum(b for _, b, g in here if g)  # a LoRA base has no moments
    out = torch.tensor(
        [resident_bytes(params, head, trained_bytes=trained, **flags)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.item()


def generation_copy(
    policy: Any,
    args: ModelArgs,
    rcfg: Any,
    info: Any,
    dtype: torch.dtype | None,
    *,
    offload_optimizer: bool,
    reference: bool,
    critic: bool,
    bucket_bytes: int,
    tp: int,
) -> GenerationCopy:
    """Collective: the generation layout (``tp`` ranks per generator, ``rollout.tp`` or what the
    run's features fix; 0 resolved by `choose_rollout_tp`) and the policy's copy into it, moved
    in buckets of ``bucket_bytes``; one ConfigError line when the model cannot be split that
    way. ``reference`` / ``critic``: the run keeps those models too."""
    from tandem.rl.config.schema import ConfigError

    dev, world = info.device, info.world_size
    resident = rank_resident_bytes(
        policy, dev, offload_optimizer=offload_optimizer, reference=reference, critic=critic
    )
    device_bytes = seam.total_memory(dev)
    dtype = dtype or next(iter(policy.state_module.parameters())).dtype
    tp = choose_rollout_tp(
        tp,
        rcfg,
        args,
        dtype,
        world=world,
        devices_per_node=info.local_world_size,
        device_bytes=device_bytes,
        resident=resident,
    )
    if world % tp:
        raise ConfigError(f"rollout.tp: {tp} does not divide the {world} ranks")
    reason = check_divisible(args, tp)
    if reason:
        raise ConfigError(f"rollout.tp: {reason}")
    layout = make_layout(tp, rcfg.vocab_parallel)
    if info.is_main and tp > 1:
        print(
            f"generation layout: {world // tp} group(s) of {tp} ranks "
            f"(vocab {'split' if layout.splits_vocab else 'whole'})",
            flush=True,
        )
    module = policy.state_module
    frozen_tower = hasattr(module, "visual") and not any(
        p.requires_grad for p in module.visual.parameters()
    )
    return GenerationCopy(
        module,
        args,
        layout,
        dev,
        dtype,
        bucket_bytes=bucket_bytes,
        keep=("visual.",) if frozen_tower else (),
        cpu_onednn=rcfg.cpu_onednn,
        lora=lora_spec_of(policy.modules[0]),
        weight_format=WEIGHT_FORMATS.get(rcfg.weight_dtype),  # None: bf16, no quantization
    )


def generation_dtype(
    setting: str, device: torch.device, mixed_precision_param: str
) -> torch.dtype | None:
    """The generation copy's dtype for ``rollout.dtype`` (None: keep the parameters' dtype).

    ``auto`` generates in the update's compute dtype where the update uses one (FSDP2 mixed
    precision applies on CUDA only), so rollout and update see the same rounding.
    """
    if setting == "auto":
        mixed = seam.capabilities(device).mixed_precision
        return getattr(torch, mixed_precision_param) if mixed else None
    return getattr(torch, setting)


def generator_settings(rcfg: Any, max_prompt_tokens: int, seed: int) -> GenerationSettings:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return GenerationSettings(
        block_size=rcfg.block_size,
        kv_cache_gb=rcfg.kv_cache_gb,
        max_num_seqs=rcfg.max_num_seqs,
        max_num_batched_tokens=rcfg.max_num_batched_tokens,
        prefix_sharing=rcfg.prefix_sharing,
        max_model_len=max_prompt_tokens + rcfg.max_tokens + 1,
        seed=seed,
        cuda_graphs=rcfg.cuda_graphs,
        step_delay_s=generator_delay(rank),
        kv_dtype=rcfg.kv_dtype,
        kv_scales=rcfg.kv_scales,
    )


def group_params(base: SamplingParams, seed: int) -> SamplingParams:
    """A prompt group's sampling: ``base`` with the group's seed (its samples add their index);
    under the long-tail drill (TANDEM_INJECT_LENGTHS) a forced length, EOS ignored."""
    length = forced_length(seed)
    if length is None:
        return dataclasses.replace(base, seed=seed)
    return dataclasses.replace(
        base, seed=seed, ignore_eos=True, max_tokens=max(1, min(length, base.max_tokens))
    )


def sampling_params(rcfg: Any, *, greedy: bool = False) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=rcfg.max_tokens)
    return SamplingParams(
        temperature=rcfg.temperature,
        top_k=rcfg.top_k,
        top_p=rcfg.top_p,
        min_p=rcfg.min_p,
        max_tokens=rcfg.max_tokens,
    )


def _with_generator(
    gen_model: Transformer,
    tokenizer: Any,
    settings: GenerationSettings,
    num_seqs: int,
    run: Callable[[Generator], Any],
    layout: GenerationLayout | None = None,
    kv_scales: torch.Tensor | None = None,
) -> tuple[Any, dict[str, float]]:
    """``run(generator)`` on a generator whose KV pool is sized for ``num_seqs`` sequences and
    freed on return (a leak raises); the rollout/* metrics of that generation. In a generation
    group (``layout.tp > 1``) every rank runs the same generator and takes the leader's tokens.
    ``kv_scales``: the FP8 pool's scales of this rank's KV heads (``rollout.kv_dtype``)."""
    t0 = time.monotonic()
    settings.max_num_seqs = min(settings.max_num_seqs, max(1, num_seqs))  # sizes the KV pool too
    agree = None
    if getattr(gen_model.args, "num_experts", 0):
        # data-dependent expert runs; routing is read per step
        settings.cuda_graphs = False
    if layout is not None and layout.tp > 1:
        # collectives inside captured decode graphs: not verified on a GPU yet
        settings.cuda_graphs = False
        agree = partial(leader_tokens, layout)
    gen = Generator(
        gen_model, settings, eos_token_ids=tokenizer.eos_token_ids, agree=agree, kv_scales=kv_scales
    )
    out = run(gen)
    if not gen.pool_is_free():
        raise RuntimeError("generator leaked KV blocks")
    stats, cache = gen.stats, gen.cache
    per_seq = -(-gen.scheduler.max_model_len // cache.block_size)
    # capacity: how many full-length sequences the budget holds
    kv = {
        "rollout/kv_cache_gb": cache.nbytes / 1e9,
        "rollout/kv_capacity_seqs": float(cache.budget_blocks // per_seq),
    }
    if cache.quant is not None and not cache.quant.per_token:
        kv["rollout/kv_saturated_frac"] = cache.saturated_share()
    gen.close()
    dt = time.monotonic() - t0
    return out, {
        "rollout/seconds": dt,
        "rollout/tokens_per_s": stats.generated_tokens / max(dt, 1e-9),
        "rollout/generated_tokens": float(stats.generated_tokens),
        "rollout/preemptions": float(stats.preemptions),
        **kv,
        **{f"rollout/{k}": float(v) for k, v in stats.extra.items() if k == "vision_tower_runs"},
    }


def leader_tokens(layout: GenerationLayout, *sampled: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every rank of a generation group takes its leader's sampled tokens and log-probs, so the
    group's schedulers stay in step even if a rank's logits differed in the last bit. One
    broadcast per step: the rows go as float64 (token ids below 2**53 and fp32 values exactly)."""
    packed = torch.stack([t.double() for t in sampled])  # [3, N]
    dist.broadcast(packed, src=layout.leader, group=layout.group)
    return tuple(row.to(t.dtype) for row, t in zip(packed, sampled))


def pool_prompts(prompts: list[Any], layout: GenerationLayout) -> tuple[list[Any], int]:
    """Collective over the generation group: every member's prompts (any picklable items), in
    rank order, and where this rank's start in that list."""
    if layout.tp == 1:
        return prompts, 0
    parts: list[Any] = [None] * layout.tp
    dist.all_gather_object(parts, prompts, group=layout.group)
    start = sum(len(p) for p in parts[: layout.rank])
    return [p for part in parts for p in part], start


def sample_completions(
    gen_model: Transformer,
    tokenizer: Any,
    prompts: list[Prompt],
    n: int,
    rcfg: Any,
    *,
    seed: int,
    max_prompt_tokens: int,
    greedy: bool = False,
    seeds: list[int] | None = None,
    layout: GenerationLayout | None = None,
    kv_scales: torch.Tensor | None = None,
) -> tuple[list[RolloutSample], dict[str, float]]:
    """n completions per prompt with the in-house generator; the KV pool is freed on return.

    ``seeds``: one per prompt (its samples use seed + sample index), so a sample's noise does
    not depend on which other prompts share the generator; None derives them from ``seed``
    and the batch slot. In a generation group (``layout.tp > 1``; every rank calls, with its
    own prompts, possibly none, and the group's one ``seed``) the members' prompts are
    generated together and each rank gets the samples of its own prompts."""
    mine = list(zip(prompts, seeds if seeds is not None else [None] * len(prompts)))
    pooled, start = pool_prompts(mine, layout or GenerationLayout())
    if not pooled:
        return [], {}
    check = stop_strings_check(tokenizer.decode, rcfg.stop) if rcfg.stop else None
    base = sampling_params(rcfg, greedy=greedy)
    params = base if seeds is None else [group_params(base, s) for _, s in pooled]
    out, metrics = _with_generator(
        gen_model,
        tokenizer,
        generator_settings(rcfg, max_prompt_tokens, seed),
        len(pooled) * n,
        lambda gen: gen.generate(
            [p.token_ids for p, _ in pooled],
            params,
            n=n,
            stop_check=check,
            images=[p.images for p, _ in pooled],
        ),
        layout,
        kv_scales,
    )
    samples = []
    for group, (p, comps) in enumerate(zip(prompts, out[start : start + len(prompts)])):
        for c in comps:
            lp = iter(c.raw_logprobs)
            gen_lp = [next(lp) if m else 0.0 for m in c.sampled_mask]
            samples.append(
                RolloutSample(
                    group=group,
                    prompt_ids=p.token_ids,
                    completion_ids=c.token_ids,
                    loss_mask=c.sampled_mask,
                    gen_logprobs=gen_lp,
                    finish_reason=c.finish_reason,
                    text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                    row=p.row,
                    routing=c.routing,
                    images=p.images,
                )
            )
    return samples, metrics


def sample_episodes(
    gen_model: Transformer,
    tokenizer: Any,
    prompts: list[Prompt],
    n: int,
    rcfg: Any,
    ecfg: Any,
    pool: Any,
    *,
    seed: int,
    greedy: bool = False,
    seeds: list[int] | None = None,
    layout: GenerationLayout | None = None,
    kv_scales: torch.Tensor | None = None,
) -> tuple[list[RolloutSample], dict[str, float]]:
    """n multi-turn episodes per prompt against ``ecfg.name`` (tandem/rl/rollout/agentic.py);
    the KV pool is freed on return.

    In a generation group (``layout.tp > 1``) the members' prompts are pooled as in
    `sample_completions` (every rank calls, possibly with none); only the leader's ``pool``
    steps the environments (the others may pass None); each rank gets its own prompts'
    episodes back, and the ``env/*`` and ``rollout/*`` metrics of the whole group."""
    from tandem.rl.rollout.agentic import run_agentic_rollout

    layout = layout or GenerationLayout()
    pooled, start = pool_prompts(
        list(zip(prompts, seeds if seeds is not None else [None] * len(prompts))), layout
    )
    if not pooled:
        return [], {}
    # max_model_len: the episode cap
    settings = generator_settings(rcfg, ecfg.max_total_tokens - rcfg.max_tokens, seed)
    (samples, env_metrics), metrics = _with_generator(
        gen_model,
        tokenizer,
        settings,
        len(pooled) * n,
        lambda gen: run_agentic_rollout(
            gen,
            tokenizer,
            ecfg.name,
            ecfg.kwargs,
            [p.row for p, _ in pooled],
            n,
            sampling_params(rcfg, greedy=greedy),
            max_turns=ecfg.max_turns,
            max_total_tokens=ecfg.max_total_tokens,
            pool=pool,
            max_turn_tokens=ecfg.max_turn_tokens,
            seeds=None if seeds is None else [s for _, s in pooled],
            layout=layout,
        ),
        layout,
        kv_scales,
    )
    mine = samples[start * n : (start + len(prompts)) * n]
    for s in mine:
        s.group -= start
    return mine, {**env_metrics, **metrics}
