"""The rollout phase: move the policy into its generation layout, sample, score.

The generation copy is a `Transformer` of one generation shard (the whole model when
``rollout.tp = 1``), filled from the policy's FSDP2 / TP / pipeline shards by a
bucketed reshard (`GenerationCopy`); it lives only for the rollout and is dropped
before the update phase, as is the KV pool the generator carves from its budget.
Both sizes, the bytes moved and the reshard time are reported. With ``rollout.tp > 1``
the ranks of a generation group pool their prompts and run one generator together
(`generate_in_group`).

With LoRA adapters the copy runs them unmerged, like the update: its frozen base moves
once, at the first build, and stays; every later build moves only the adapters and checks
them against the trainer's by an exact checksum (a mismatch is an error).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.kernels import batch_invariant
from tandem.kernels.cpu_linear import OneDNNLinear, onednn_linear_available, use_onednn_linears
from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, apply_lora, is_adapter, lora_spec_of
from tandem.models.transformer import Transformer
from tandem.models.vlm import make_model
from tandem.parallel.ac import clean_fqn
from tandem.parallel.generation_layout import (
    GenerationLayout,
    check_divisible,
    local_args,
    make_layout,
    needed_box,
    shard_bytes,
    shard_modules,
    state_tensors,
)
from tandem.parallel.reshard import Box, Resharder, held
from tandem.rl.data.prompts import Prompt
from tandem.rl.fault.inject import forced_length, generator_delay
from tandem.rl.generator.engine import GenerationSettings, Generator, stop_strings_check
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample


class GenerationCopy:
    """The rollout's copy of the policy, in the generation layout (tandem/parallel/generation_layout.py).

    ``module``: the policy's parameters under the whole model's names (an tandem/rl/update/policy.py
    policy's ``state_module``: FSDP2 / TP DTensors, or this rank's pipeline stages).
    `build` moves, bucket by bucket, only the regions this rank's generation shard needs, in
    the generation dtype (tandem/parallel/reshard.py), so no rank ever holds the whole model unless
    its shard is the whole model (``layout.tp = 1``). The move's plan is worked out at the
    first build (collective) and kept: the layouts do not change during a run.

    ``keep``: name prefixes of parameters that never change during the run (a frozen vision
    tower, ``"visual."``): the generation copy and the policy have the same names, so this
    explicit map is all the reshard needs; they move at the first build only and their copies
    are kept for the next rollouts (``reshard/kept_gb``; the only rollout memory the update
    phase still holds), so later builds move only what training changed.
    """

    def __init__(self, module: nn.Module, args: ModelArgs, layout: GenerationLayout, device: torch.device,
                 dtype: torch.dtype | None = None, *, bucket_bytes: int = 256 << 20,
                 keep: tuple[str, ...] = (), cpu_onednn: bool = False,
                 lora: LoraSpec | None = None) -> None:
        self.module, self.args, self.layout, self.device = module, args, layout, device
        self.cpu_onednn = cpu_onednn  # rollout.cpu_onednn: see `inference_layout`
        self.local = local_args(args, layout)
        self.lora = lora  # adapters: the copy is kept, and refilled with them alone (`_refill`)
        with torch.device("meta"):
            meta = make_model(args)
            if lora is not None:
                apply_lora(meta, lora)
        self.shapes = {name: tuple(t.shape) for name, t in state_tensors(meta).items()}  # tied: counted once
        first = next(iter(module.parameters()), None)
        self.dtype = dtype or (first.dtype if first is not None else torch.float32)
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self._kept_state: dict[str, torch.Tensor] = {}  # the kept names' copies, after the first build
        self._plans: dict[bool, Resharder] = {}  # the first build's plan and, with ``keep``, the later builds'
        self._adapter_plan: Resharder | None = None
        self._kept: tuple[Transformer, dict[str, torch.Tensor]] | None = None  # LoRA: the copy and its adapters

    def _moving(self) -> dict[str, tuple[int, ...]]:
        """The names this build moves: all at first, then all but the kept ones."""
        later = bool(self._kept_state)
        return {n: shape for n, shape in self.shapes.items() if not (later and n.startswith(self.keep))}

    def _held(self) -> dict[str, tuple[torch.Tensor, Box]]:
        out = {}
        for name, p in [*self.module.named_parameters(), *self.module.named_buffers()]:
            name = clean_fqn(name)
            if name in self.shapes:  # a pipeline rank's second copy of a tied head is not moved
                out[name] = held(p.detach())
        return out

    def build(self, *, inference: bool = True,
              probe: Callable[[], None] | None = None) -> tuple[Transformer, dict[str, float]]:
        """Collective (every rank): this rank's generation shard as a runnable model.

        ``inference``: the copy gets `inference_layout` (False: the training layout, for tests;
        a copy with adapters keeps the training layout). ``probe()`` runs inside every reshard
        collective (memory tests)."""
        if self._kept is not None:
            return self._refill(probe)
        moving = self._moving()
        later = bool(self._kept_state)
        srcs = {n: src for n, src in self._held().items() if n in moving}
        adapter_srcs = {n: t for n, (t, _) in srcs.items() if is_adapter(n)}
        state, stats = self._move(moving, srcs, None, probe)
        del srcs
        if self.keep and not later:
            self._kept_state = {n: t for n, t in state.items() if n.startswith(self.keep)}
        state.update(self._kept_state)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        kept_bytes = sum(t.numel() * t.element_size() for t in self._kept_state.values())
        if self.args.tie_word_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        with torch.device("meta"):
            gen = make_model(self.local)
            if self.lora is not None:
                apply_lora(gen, self.lora)
        gen.load_state_dict(state, assign=True, strict=True)
        gen.tie_weights()
        gen.rope.to_empty(device=self.device)  # materialise and recompute the RoPE table
        if hasattr(gen, "visual"):
            gen.visual.reset_rope(self.device)
        gen.requires_grad_(False).eval()
        if inference and self.lora is None:  # fused projections would fold the adapters' inputs
            inference_layout(gen, self.cpu_onednn)
        metrics = _reshard_metrics(stats, nbytes, kept_bytes)
        if self.lora is not None:  # before shard_modules renames
            adapters = {n: p for n, p in gen.named_parameters() if is_adapter(n)}
            self._kept = (gen, adapters)
            metrics.update(self._check(adapter_srcs, adapters))
        gen.refill_views = gen.unfused_views()  # before the wrappers rename the shard's modules
        shard_modules(gen, self.args, self.layout)
        return gen, metrics

    def refill(self, gen: Transformer, *,
               probe: Callable[[], None] | None = None) -> dict[str, float]:
        """Collective: the policy's current weights into ``gen`` (a model `build` made), in place:
        its tensors, and whatever holds them (a generator's captured graphs, its hooks), stay.
        With adapters: the kept copy's adapters alone (`_refill`); kept names (``keep``) stay."""
        if self._kept is not None:
            return self._refill(probe)[1]
        moving = self._moving()
        srcs = {n: src for n, src in self._held().items() if n in moving}
        state, stats = self._move(moving, srcs, gen.refill_views, probe)
        for m in gen.modules():  # oneDNN's blocked copies are of the old weights
            if isinstance(m, OneDNNLinear) and m.packed is not None:
                m.pack()
        kept = sum(t.numel() * t.element_size() for t in self._kept_state.values())
        moved = sum(t.numel() * t.element_size() for t in state.values())
        return _reshard_metrics(stats, moved + kept, kept)  # the copy's size, as `build` reports

    def _move(self, moving: dict[str, tuple[int, ...]], srcs: dict[str, tuple[torch.Tensor, Box]],
              into: dict[str, torch.Tensor] | None,
              probe: Callable[[], None] | None) -> tuple[dict[str, torch.Tensor], Any]:
        """Collective: the move of ``moving`` (planned at its first call: one plan for the first
        build, one for the later ones without the kept names), into new tensors or ``into``'s."""
        later = bool(self._kept_state)
        if later not in self._plans:
            self._plans[later] = self._make_plans(moving, srcs)
        return self._plans[later].run({n: t for n, (t, _) in srcs.items()}, self.dtype,
                                      self.device, probe=probe, into=into)

    def _make_plans(self, moving: dict[str, tuple[int, ...]],
                    srcs: dict[str, tuple[torch.Tensor, Box]]) -> Resharder:
        """The reshard plan of ``moving``; with adapters, also the plan of the adapters alone."""
        needs = {n: needed_box(n, shape, self.layout) for n, shape in moving.items()}
        elem = torch.empty((), dtype=self.dtype).element_size()
        if self.lora is not None:  # the adapters alone, for every later build
            names = [n for n in moving if is_adapter(n)]
            self._adapter_plan = Resharder({n: self.shapes[n] for n in names},
                                           {n: srcs[n][1] for n in names if n in srcs},
                                           {n: needs[n] for n in names}, elem,
                                           bucket_bytes=self.bucket_bytes)
        return Resharder(moving, {n: b for n, (_, b) in srcs.items()}, needs, elem,
                         bucket_bytes=self.bucket_bytes)

    def _refill(self, probe: Callable[[], None] | None) -> tuple[Transformer, dict[str, float]]:
        """Collective: the kept copy with the trainer's current adapters moved in (nothing else)."""
        assert self._kept is not None and self._adapter_plan is not None
        gen, adapters = self._kept
        srcs = {n: t for n, (t, _) in self._held().items() if n in adapters}
        state, stats = self._adapter_plan.run(srcs, self.dtype, self.device, probe=probe)
        with torch.no_grad():
            for n, t in state.items():
                adapters[n].copy_(t)
        metrics = _reshard_metrics(stats, sum(t.numel() * t.element_size() for t in state.values()))
        del state
        metrics.update(self._check(srcs, adapters))
        return gen, metrics

    def _check(self, srcs: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, float]:
        """Collective: the copy's adapters against the trainer's (exact checksum); RuntimeError if any differ."""
        assert self._adapter_plan is not None
        t0 = time.monotonic()
        total, wrong = self._adapter_plan.verify(srcs, adapters, self.dtype)
        if wrong:
            raise RuntimeError(f"generation copy: adapters {wrong[:3]} differ from the trainer's after the refill "
                               f"({len(wrong)} tensors; checksum)")
        return {"lora/adapter_checksum": float(total), "lora/check_seconds": time.monotonic() - t0}


def _reshard_metrics(stats: Any, nbytes: int, kept_bytes: int = 0) -> dict[str, float]:
    return {"reshard/seconds": stats.seconds, "reshard/gb": nbytes / 1e9,
            "reshard/kept_gb": kept_bytes / 1e9, "reshard/sent_gb": stats.bytes_sent / 1e9,
            "reshard/collectives": float(stats.collectives),
            "reshard/buffer_peak_gb": stats.peak_buffer_bytes / 1e9}


def choose_rollout_tp(setting: int, args: ModelArgs, world: int, device: torch.device, dtype: torch.dtype,
                      kv_cache_gb: float, training_bytes: int) -> int:
    """``rollout.tp``, with 0 (auto) resolved: 1 off CUDA; on CUDA the smallest degree that divides
    the world and the model's heads and MLP whose generation shard, plus the ``kv_cache_gb``
    pool, fits in 90 % of the device beside ``training_bytes`` (what stays resident on the
    busiest rank during the rollout: parameter and optimizer shards). Every rank must pass
    the same values (the recipe takes the maximum over ranks of ``training_bytes``)."""
    if setting:
        return setting
    if device.type != "cuda":
        return 1
    room = 0.9 * torch.cuda.get_device_properties(device).total_memory - training_bytes - kv_cache_gb * 1e9
    fits = [g for g in range(1, world + 1) if world % g == 0 and check_divisible(args, g) is None]
    for g in fits:
        if shard_bytes(args, GenerationLayout(tp=g), dtype) <= room:
            return g
    return fits[-1]


def generation_copy(policy: Any, args: ModelArgs, rcfg: Any, info: Any, dtype: torch.dtype | None, *,
                    offload_optimizer: bool) -> GenerationCopy:
    """Collective: the generation layout (``rollout.tp`` ranks per generator; 0 resolved by
    `choose_rollout_tp`) and the policy's copy into it; one ConfigError line when the model
    cannot be split that way."""
    from tandem.rl.config.schema import ConfigError

    dev, world = info.device, info.world_size
    params = policy.parameters()
    resident = torch.tensor([sum(held(p)[0].numel() * 4 * (1 if offload_optimizer or not p.requires_grad else 3)
                                 for p in params)],
                            dtype=torch.float64, device=dev)
    dist.all_reduce(resident, op=dist.ReduceOp.MAX)  # parameters + Adam's two moments, fp32
    tp = choose_rollout_tp(rcfg.tp, args, world, dev, dtype or params[0].dtype, rcfg.kv_cache_gb, int(resident.item()))
    if world % tp:
        raise ConfigError(f"rollout.tp: {tp} does not divide the {world} ranks")
    reason = check_divisible(args, tp)
    if reason:
        raise ConfigError(f"rollout.tp: {reason}")
    layout = make_layout(tp, rcfg.vocab_parallel)
    if info.is_main and tp > 1:
        print(f"generation layout: {world // tp} group(s) of {tp} ranks "
              f"(vocab {'split' if layout.splits_vocab else 'whole'})", flush=True)
    module = policy.state_module
    frozen_tower = hasattr(module, "visual") and not any(p.requires_grad for p in module.visual.parameters())
    return GenerationCopy(module, args, layout, dev, dtype, bucket_bytes=rcfg.reshard_bucket_mb << 20,
                          keep=("visual.",) if frozen_tower else (), cpu_onednn=rcfg.cpu_onednn,
                          lora=lora_spec_of(policy.modules[0]))


def build_generation_model(
    policy: Any,
    args: ModelArgs,
    device: torch.device,
    dtype: torch.dtype | None = None,
    *,
    layout: bool = True,
    cpu_onednn: bool = False,
) -> tuple[Transformer, dict[str, float]]:
    """Collective: a whole copy of ``policy`` (its ``state_module``) on every rank, in ``dtype``
    (None: the parameters' dtype); ``layout``: with `inference_layout`. The one-off form of
    `GenerationCopy` with ``rollout.tp = 1``."""
    copy = GenerationCopy(policy.state_module, args, GenerationLayout(), device, dtype,
                          cpu_onednn=cpu_onednn, lora=lora_spec_of(policy.state_module))
    return copy.build(inference=layout)


def inference_layout(model: Transformer, cpu_onednn: bool = False) -> bool:
    """The rollout copy's layout, in place; returns whether it changed anything.

    On CUDA: q/k/v and gate/up fused into one product each (`Transformer.fuse_projections`:
    fewer, larger products; 3-6 % faster on an H200). On the CPU the copy keeps the training
    layout unless ``cpu_onednn`` (``rollout.cpu_onednn``): then, in fp32 where PyTorch has
    oneDNN, fused and every linear on oneDNN with a prepacked weight (`tandem.kernels.cpu_linear`).
    That won on an AMD EPYC and lost on an Intel Xeon with AMX, and its last-bit differences
    would make two runs of one config sample differently if a timing chose it, so it is a
    setting, off by default. Numbers: docs/performance.md."""
    weight = next(model.parameters(), None)
    if weight is None or batch_invariant.enabled():  # rl.exact: the update's own (unfused, aten) linears
        return False
    if weight.is_cuda:
        model.fuse_projections()
        return True
    if not cpu_onednn or weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or not onednn_linear_available():
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    return GenerationSettings(
        block_size=rcfg.block_size, num_blocks=rcfg.num_blocks, kv_cache_gb=rcfg.kv_cache_gb,
        max_num_seqs=rcfg.max_num_seqs, max_num_batched_tokens=rcfg.max_num_batched_tokens,
        prefix_sharing=rcfg.prefix_sharing, max_model_len=max_prompt_tokens + rcfg.max_tokens + 1,
        kernels=None if rcfg.kernels == "auto" else rcfg.kernels, seed=seed, cuda_graphs=rcfg.cuda_graphs,
        step_delay_s=generator_delay(rank), kv_dtype=rcfg.kv_dtype, kv_scales=rcfg.kv_scales,
    )


def group_params(base: SamplingParams, seed: int) -> SamplingParams:
    """A prompt group's sampling: ``base`` with the group's seed (its samples add their index);
    under the long-tail drill (TANDEM_INJECT_LENGTHS) a forced length, EOS ignored."""
    length = forced_length(seed)
    if length is None:
        return dataclasses.replace(base, seed=seed)
    return dataclasses.replace(base, seed=seed, ignore_eos=True,
                               max_tokens=max(1, min(length, base.max_tokens)))


def sampling_params(rcfg: Any, *, greedy: bool = False) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=rcfg.max_tokens)
    return SamplingParams(temperature=rcfg.temperature, top_k=rcfg.top_k, top_p=rcfg.top_p, min_p=rcfg.min_p,
                          max_tokens=rcfg.max_tokens)


def _with_generator(gen_model: Transformer, tokenizer: Any, settings: GenerationSettings, num_seqs: int,
                    run: Callable[[Generator], Any], layout: GenerationLayout | None = None,
                    kv_scales: torch.Tensor | None = None) -> tuple[Any, dict[str, float]]:
    """``run(generator)`` on a generator whose KV pool is sized for ``num_seqs`` sequences and
    freed on return (a leak raises); the rollout/* metrics of that generation. In a generation
    group (``layout.tp > 1``) every rank runs the same generator and takes the leader's tokens.
    ``kv_scales``: the FP8 pool's scales of this rank's KV heads (``rollout.kv_dtype``)."""
    t0 = time.monotonic()
    settings.max_num_seqs = min(settings.max_num_seqs, max(1, num_seqs))  # sizes the KV pool too
    agree = None
    if getattr(gen_model.args, "num_experts", 0):  # data-dependent expert runs; routing is read per step
        settings.cuda_graphs = False
    if layout is not None and layout.tp > 1:
        settings.cuda_graphs = False  # collectives inside captured decode graphs: not verified on a GPU yet
        agree = partial(leader_tokens, layout)
    gen = Generator(gen_model, settings, eos_token_ids=tokenizer.eos_token_ids, agree=agree,
                    kv_scales=kv_scales)
    out = run(gen)
    if not gen.pool_is_free():
        raise RuntimeError("generator leaked KV blocks")
    stats, cache = gen.stats, gen.cache
    per_seq = -(-gen.scheduler.max_model_len // cache.block_size)
    # capacity: how many full-length sequences the budget holds
    kv = {"rollout/kv_cache_gb": cache.nbytes / 1e9,
          "rollout/kv_capacity_seqs": float(cache.budget_blocks // per_seq)}
    if cache.quant is not None and not cache.quant.per_token:
        kv["rollout/kv_saturated_frac"] = cache.saturated_share()
    gen.close()
    dt = time.monotonic() - t0
    return out, {"rollout/seconds": dt, "rollout/tokens_per_s": stats.generated_tokens / max(dt, 1e-9),
                 "rollout/generated_tokens": float(stats.generated_tokens),
                 "rollout/preemptions": float(stats.preemptions), **kv,
                 **{f"rollout/{k}": float(v) for k, v in stats.extra.items() if k == "vision_tower_runs"}}


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


def generate_samples(gen_model: Transformer, tokenizer: Any, prompts: list[Prompt], n: int, rcfg: Any, *,
                     seed: int, max_prompt_tokens: int, greedy: bool = False, seeds: list[int] | None = None,
                     layout: GenerationLayout | None = None, kv_scales: torch.Tensor | None = None,
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
        gen_model, tokenizer, generation_settings(rcfg, max_prompt_tokens, seed), len(pooled) * n,
        lambda gen: gen.generate([p.token_ids for p, _ in pooled], params, n=n, stop_check=check,
                                 images=[p.images for p, _ in pooled]), layout, kv_scales)
    samples = []
    for group, (p, comps) in enumerate(zip(prompts, out[start:start + len(prompts)])):
        for c in comps:
            lp = iter(c.raw_logprobs)
            gen_lp = [next(lp) if m else 0.0 for m in c.sampled_mask]
            samples.append(RolloutSample(group=group, prompt_ids=p.token_ids, completion_ids=c.token_ids,
                                         loss_mask=c.sampled_mask, gen_logprobs=gen_lp,
                                         finish_reason=c.finish_reason,
                                         text=tokenizer.decode(c.token_ids, skip_special_tokens=True), row=p.row,
                                         routing=c.routing, images=p.images))
    return samples, metrics


def generate_episodes(gen_model: Transformer, tokenizer: Any, prompts: list[Prompt], n: int, rcfg: Any, ecfg: Any,
                      pool: Any, *, seed: int, greedy: bool = False, seeds: list[int] | None = None,
                      layout: GenerationLayout | None = None, kv_scales: torch.Tensor | None = None,
                      ) -> tuple[list[RolloutSample], dict[str, float]]:
    """n multi-turn episodes per prompt against ``ecfg.name`` (tandem/rl/rollout/agentic.py); the KV pool is freed on return.

    In a generation group (``layout.tp > 1``) the members' prompts are pooled as in
    `generate_samples` (every rank calls, possibly with none); only the leader's ``pool``
    steps the environments (the others may pass None); each rank gets its own prompts'
    episodes back, and the ``env/*`` and ``rollout/*`` metrics of the whole group."""
    from tandem.rl.rollout.agentic import run_agentic_rollout

    layout = layout or GenerationLayout()
    pooled, start = pool_prompts(list(zip(prompts, seeds if seeds is not None else [None] * len(prompts))), layout)
    if not pooled:
        return [], {}
    settings = generation_settings(rcfg, ecfg.max_total_tokens - rcfg.max_tokens, seed)  # max_model_len: the episode cap
    (samples, env_metrics), metrics = _with_generator(
        gen_model, tokenizer, settings, len(pooled) * n,
        lambda gen: run_agentic_rollout(gen, tokenizer, ecfg.name, ecfg.kwargs, [p.row for p, _ in pooled], n,
                                        sampling_params(rcfg, greedy=greedy), max_turns=ecfg.max_turns,
                                        max_total_tokens=ecfg.max_total_tokens, pool=pool,
                                        max_turn_tokens=ecfg.max_turn_tokens,
                                        seeds=None if seeds is None else [s for _, s in pooled], layout=layout),
        layout, kv_scales)
    mine = samples[start * n:(start + len(prompts)) * n]
    for s in mine:
        s.group -= start
    return mine, {**env_metrics, **metrics}
