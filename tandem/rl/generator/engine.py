"""The generation loop: prompts in, completions (tokens, log-probs, reasons) out.

`Generator` is created for one rollout: it carves the KV pool, runs the
scheduler/runner loop until every request finishes, and frees the pool on
`close()`. The model is the trainer's own `Transformer` (in the generation
layout); the generator opens no ports and uses no process group of its own.
Multi-turn callers drive it step by step (`add`, `step`, `pause`, `append`,
`resume`) while environments run elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tandem import device as seam
from tandem.models.transformer import Transformer
from tandem.rl.generator.block_manager import BlockManager, StateSlots
from tandem.rl.generator.kv_cache import KVCache, make_quant
from tandem.rl.generator.recurrent_state import RecurrentState
from tandem.rl.generator.runner import ModelRunner
from tandem.rl.generator.scheduler import Scheduler
from tandem.rl.generator.sequence import SamplingParams, Sequence


@dataclass
class GenerationSettings:
    """Engine sizes (the ``[generator]`` config section maps onto this)."""

    block_size: int = 16
    num_blocks: int = 0  # 0: derive from kv_cache_gb
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefix_sharing: bool = True
    max_model_len: int | None = None
    kernels: str | None = None  # None: Triton on CUDA, PyTorch elsewhere; "torch" | "triton" force
    seed: int = 0
    cuda_graphs: bool = False  # decode steps replay captured graphs (CUDA only; eager elsewhere)
    graphs_capture: bool | None = None  # None: capture on CUDA; False: padded path without capture
    # (tests)
    decode_mirror: bool = True  # PyTorch attention path: decode steps read contiguous rows, not
    # gathered pages
    compile_decode: bool | str | None = None  # decode steps on the mirror through a compiled
    # step (compiled_decode.py): True | False | "auto"; None: the process's choice (off unless set)
    step_delay_s: float = 0.0  # sleep after every step (a slow generator, for drills)
    kv_dtype: str = "auto"  # "auto": pages in the model's dtype; "fp8_e4m3" | "fp8_e5m2": FP8 pages
    kv_scales: str = "calibrated"  # FP8: "calibrated" (the Generator's kv_scales) | "per_token"


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # everything after the prompt
    sampled_mask: list[bool]  # per completion token: sampled by the policy (loss mask)
    logprobs: list[float]  # per sampled token, under the sampling distribution
    raw_logprobs: list[float]  # per sampled token, temperature 1, no truncation
    finish_reason: str
    text: str | None = None
    routing: torch.Tensor | None = None  # MoE: [C, L, k] experts of the inputs producing each
    # completion token


@dataclass
class GenerationStats:
    steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    kv_cache_bytes: int = 0
    extra: dict = field(default_factory=dict)


def _to_completion(seq: Sequence, prompt_index: int, sample_index: int) -> Completion:
    return Completion(
        prompt_index,
        sample_index,
        seq.token_ids[: seq.num_prompt_tokens],
        seq.completion_token_ids,
        seq.completion_sampled_mask,
        list(seq.logprobs),
        list(seq.raw_logprobs),
        seq.finish_reason or "abort",
    )


class Generator:
    def __init__(
        self,
        model: Transformer,
        settings: GenerationSettings,
        *,
        eos_token_ids: Seq[int] = (),
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        agree: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """``agree(tokens, logprobs, raw_logprobs)``: run on every step's samples before the
        scheduler sees them (a tensor-parallel generation group takes its leader's, in place).
        ``kv_scales [L, 2, Hkv]``: the FP8 pool's calibrated scales (``settings.kv_dtype``)."""
        self.model, self.settings = model, settings
        p = next(model.parameters())
        device = device or p.device
        dtype = dtype or p.dtype
        max_len = settings.max_model_len or model.args.max_position_embeddings
        quant = make_quant(settings.kv_dtype, settings.kv_scales, kv_scales)
        if settings.num_blocks > 0:
            cache = KVCache(
                model.args, settings.num_blocks, settings.block_size, dtype, device, quant
            )
        else:
            # The budget is an upper bound: never more blocks than max_num_seqs
            # sequences of max_len tokens could hold at once (a small rollout
            # then zeroes megabytes, not the whole budget).
            most = settings.max_num_seqs * -(-max_len // settings.block_size)
            cache = KVCache.from_budget(
                model.args,
                int(settings.kv_cache_gb * 1e9),
                settings.block_size,
                dtype,
                device,
                max_blocks=most,
                quant=quant,
            )
        self.cache = cache
        # linear-attention layers (Qwen3.5): a recurrent state per sequence slot, one slot for
        # each sequence that may run at once
        self.recurrent: RecurrentState | None = None
        slots = None
        if model.args.linear is not None:
            self.recurrent = RecurrentState(model.args, settings.max_num_seqs, dtype, device)
            slots = StateSlots(settings.max_num_seqs)
        self.scheduler = Scheduler(
            BlockManager(cache.num_blocks, cache.block_size),
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            settings.prefix_sharing,
            max_model_len=max_len,
            eos_token_ids=eos_token_ids,
            state_slots=slots,
        )
        self.runner = ModelRunner(
            model,
            cache,
            default_seed=settings.seed,
            impl=settings.kernels,
            cuda_graphs=settings.cuda_graphs,
            max_model_len=max_len,
            graphs_capture=settings.graphs_capture,
            decode_mirror=settings.decode_mirror,
            compile_decode=settings.compile_decode,
            agree=agree,
            recurrent=self.recurrent,
        )
        state_bytes = self.recurrent.nbytes if self.recurrent is not None else 0
        self.stats = GenerationStats(kv_cache_bytes=cache.nbytes + state_bytes)
        self._kv_home = cache.data.device  # where the pool lives when not offloaded
        self._kv_shape = (tuple(cache.data.shape), cache.data.dtype)
        self._next_id = 0
        self._stop_check: dict[int, Callable[[Sequence], bool]] = {}

    # ---- step-level API (multi-turn) -----------------------------------------------------

    def add(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        stop_check: Callable[[Sequence], bool] | None = None,
        images: object = None,
    ) -> list[Sequence]:
        """Queue n samples of one prompt (a group sharing the prompt's KV blocks); ``images``:
        the prompt's `tandem.models.vlm.PromptImages` (a vision-language model's image prompt)."""
        seqs = []
        for i in range(n):
            p = params
            if params.seed is not None and n > 1:
                p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            seqs.append(Sequence(self._next_id, prompt_token_ids, p, images=images))
            self._next_id += 1
        self.scheduler.add_group(seqs)
        if stop_check is not None:
            for s in seqs:
                self._stop_check[s.seq_id] = stop_check
        return seqs

    def step(self) -> list[Sequence]:
        """Run one scheduler step; returns the sequences that finished in it."""
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if out.is_empty:
            return []
        sampled = self.runner.run(out)
        if self.settings.step_delay_s:
            time.sleep(self.settings.step_delay_s)
        done = self.scheduler.postprocess(out, sampled)
        self.stats.steps += 1
        self.stats.generated_tokens += len(sampled)
        self.stats.prefill_tokens += out.num_batched_tokens - len(sampled)
        for c in out.sample_chunks:
            seq = c.seq
            check = self._stop_check.get(seq.seq_id)
            if check is not None and not seq.is_finished and check(seq):
                self.scheduler.abort(seq)
                seq.finish_reason = "stop"
                done.append(seq)
        return done

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` for good and free its blocks (its routing record and stop check go)."""
        self.scheduler.abort(seq)
        self.runner.routing.by_seq.pop(seq.seq_id, None)
        self._stop_check.pop(seq.seq_id, None)

    def pause(self, seq: Sequence) -> None:
        self.scheduler.pause(seq)

    def append(self, seq: Sequence, token_ids: list[int]) -> None:
        self.scheduler.append_tokens(seq, token_ids)

    def resume(self, seq: Sequence) -> None:
        self.scheduler.resume(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_schedulable()

    def add_resumed(
        self, seq: Sequence, stop_check: Callable[[Sequence], bool] | None = None
    ) -> None:
        """Queue a sequence that already holds sampled tokens (a fresh `Sequence` with its
        tokens, masks and log-probs restored); it recomputes its K/V and samples on."""
        seq.seq_id = self._next_id
        self._next_id += 1
        self.scheduler.add_resumed(seq)
        if stop_check is not None:
            self._stop_check[seq.seq_id] = stop_check

    # ---- suspending through an update (colocated asynchronous RL) -----------------------

    def offload_kv(self) -> None:
        """Move the KV pool (and the decode rows beside it) to host memory; `restore_kv` brings
        the same values back, so the sequences continue as if nothing happened."""
        host = self.cache.data.to("cpu", copy=True)
        self.cache.data = seam.pin(host, self._kv_home)
        if self.recurrent is not None:
            self.recurrent.to("cpu")
        if self.runner.mirror is not None:
            self.runner.mirror.rows = self.runner.mirror.rows.to("cpu", copy=True)

    def restore_kv(self) -> None:
        self.cache.data = self.cache.data.to(self._kv_home)
        if self.recurrent is not None:
            self.recurrent.to(self._kv_home)
        if self.runner.mirror is not None:
            self.runner.mirror.rows = self.runner.mirror.rows.to(self._kv_home)

    def set_kv_scales(self, scales: torch.Tensor | None) -> int:
        """New calibrated FP8 scales (a streaming rollout's next version): the pool's stored
        entries are re-quantised to them (`KVCache.rescale`); returns the heads re-quantised.
        Nothing to do without FP8 or with per-token scales (each entry keeps its own)."""
        quant = self.cache.quant
        if quant is None or quant.per_token:
            return 0
        if scales is None:
            raise ValueError("an FP8 pool with calibrated scales was given no scales")
        return self.cache.rescale(scales)

    def release_kv(self) -> None:
        """Free the KV pool: every unfinished sequence recomputes its K/V (with whatever weights
        the model then has) when `reacquire_kv` has carved the pool again."""
        self.scheduler.preempt_all()
        self.cache.data = self.cache.data.new_empty(0)
        if self.recurrent is not None:
            self.recurrent.release()
        mirror = self.runner.mirror
        if mirror is not None:
            layers, two, _, heads, _, dim = mirror.rows.shape
            mirror.rows = mirror.rows.new_empty(layers, two, 0, heads, 0, dim)
            mirror.seq_ids, mirror.lengths = [], []

    def reacquire_kv(self) -> None:
        shape, dtype = self._kv_shape
        self.cache.data = torch.zeros(shape, dtype=dtype, device=self._kv_home)
        if self.recurrent is not None:
            self.recurrent.reacquire(self._kv_home)

    # ---- batch API ---------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        n: int = 1,
        stop_check: Callable[[Sequence], bool] | None = None,
        images: list[object] | None = None,
    ) -> list[list[Completion]]:
        """Generate n completions per prompt; result[i][j] is sample j of prompt i; ``images``:
        per prompt, its PromptImages or None."""
        t0 = time.monotonic()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images if images is not None else [None] * len(prompts)
        groups = [self.add(p, sp, n, stop_check, im) for p, sp, im in zip(prompts, plist, ilist)]
        while self.scheduler.has_unfinished():
            if not self.scheduler.has_schedulable():
                raise RuntimeError(
                    "generate: paused sequences remain; use the step API for multi-turn"
                )
            self.step()
        self.stats.seconds += time.monotonic() - t0
        if self.runner.vision is not None:
            self.stats.extra["vision_tower_runs"] = self.runner.vision.tower_runs
        out = [[_to_completion(s, i, j) for j, s in enumerate(g)] for i, g in enumerate(groups)]
        for comps, seqs in zip(out, groups):
            for c, s in zip(comps, seqs):
                c.routing = self.routing(s)
        return out

    def routing(self, seq: Sequence) -> torch.Tensor | None:
        """MoE models: the experts of the inputs that produced ``seq``'s completion tokens
        (tandem/rl/generator/routing.py); None for a dense model. Read once per sequence."""
        return self.runner.routing.completion(
            seq.seq_id, seq.num_prompt_tokens, len(seq.completion_token_ids)
        )

    def routed_positions(
        self, seq: Sequence, start: int, end: int
    ) -> list[list[int] | None] | None:
        """MoE models: the experts recorded for the inputs at positions ``start .. end - 1`` of
        ``seq`` (None where none was recorded); None for a dense model."""
        routing = self.runner.routing
        if not routing.blocks:
            return None
        rows = routing.by_seq.get(seq.seq_id, {})
        return [rows[p].tolist() if p in rows else None for p in range(start, end)]

    def pool_is_free(self) -> bool:
        """No block (and no recurrent-state slot) leaked: every one is back in its free list."""
        slots = self.scheduler.state_slots
        return self.scheduler.block_manager.all_free() and (slots is None or slots.all_free())

    def close(self) -> None:
        """Release the KV pool (the rollout's memory goes back to training)."""
        if self.runner.graphs is not None:
            self.runner.graphs.close()
            self.runner.graphs = None
        self.cache = None  # type: ignore[assignment]
        self.runner.cache = None  # type: ignore[assignment]
        self.recurrent = self.runner.recurrent = None
        self.runner.mirror = self.runner.compiled = None
        if self.runner.vision is not None:
            self.runner.vision.release()


def stop_strings_check(
    decode: Callable[[list[int]], str], stops: Seq[str]
) -> Callable[[Sequence], bool]:
    """A stop check that fires when a completion's text contains one of ``stops``."""
    if not stops:
        return lambda seq: False
    # tokens: enough for any stop string to appear whole
    window = 4 * max(len(s) for s in stops) + 8

    def check(seq: Sequence) -> bool:
        tail = decode(seq.completion_token_ids[-window:])
        return any(s in tail for s in stops)

    return check
