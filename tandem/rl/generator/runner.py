"""Turn one scheduled step into tensors, run the model's paged path, sample.

The runner owns no scheduling policy: it receives a `SchedulerOutput`, builds
the flattened step (tokens, positions, slot mapping, block tables, context
lengths), runs the policy's own `Transformer` with a `PagedAttention` backend,
samples the chunks that end at a sampling point, and returns what was sampled.
Attention metadata is passed explicitly to the backend; nothing is global.
With ``cuda_graphs`` on, pure decode steps go through `DecodeGraphs`
(bucketed, padded static buffers, captured on CUDA with the Triton attention
kernels); everything else, every step off CUDA unless ``graphs_capture=False``
forces the padded path for testing, and every step on the PyTorch attention
path (``advanced.kernels = "torch"``), runs eagerly. On the PyTorch attention path (off CUDA, fp32
caches) pure decode steps read contiguous per-sequence rows kept by a
`DecodeMirror` instead of gathering the pages at every layer
(``decode_mirror=False``: always gather); with ``compile_decode`` those steps go through one
torch.compile'd step (`CompiledDecode`, tandem/rl/generator/compiled_decode.py). A
vision-language model's steps get their M-RoPE positions and image rows from `VisionSteps`
(tandem/rl/generator/vision.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tandem import device as seam
from tandem.kernels import batch_invariant
from tandem.kernels.dispatch import use_triton
from tandem.models.attention import AttentionBackend
from tandem.models.linear_attention import Segments
from tandem.models.transformer import Transformer
from tandem.rl.generator.compiled_decode import (
    CompiledDecode,
    choose,
    compiled_uniforms,
    process_choice,
    supported,
)
from tandem.rl.generator.cuda_graphs import DecodeGraphs
from tandem.rl.generator.decode_mirror import DecodeMirror, MirrorAttention
from tandem.rl.generator.kv_cache import KVCache, PagedAttention, PagedMeta
from tandem.rl.generator.recurrent_state import RecurrentState
from tandem.rl.generator.routing import RoutingRecorder
from tandem.rl.generator.sampler import Sampler
from tandem.rl.generator.scheduler import SchedulerOutput
from tandem.rl.generator.vision import VisionSteps

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        default_seed: int = 0,
        impl: str | None = None,
        cuda_graphs: bool = False,
        max_model_len: int | None = None,
        graphs_capture: bool | None = None,
        decode_mirror: bool = True,
        compile_decode: bool | str | None = None,
        agree: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        recurrent: RecurrentState | None = None,
    ) -> None:
        self.model, self.cache, self.impl, self.agree = model, cache, impl, agree
        self.recurrent = recurrent  # linear-attention layers' per-sequence state
        # MoE models: each token's experts, for the update's parity check
        self.routing = RoutingRecorder(model)
        self.vision = (
            VisionSteps(model) if getattr(model.args, "vision", None) is not None else None
        )
        self.default_seed = default_seed
        self.sampler = Sampler()
        self.device = cache.data.device
        self.scale = model.args.head_dim**-0.5
        graphs = seam.capabilities(self.device).graphs
        if cuda_graphs and not graphs:
            seam.fallback(self.device, "rollout.cuda_graphs", "graph capture (decode runs eagerly)")
        capture = graphs if graphs_capture is None else graphs_capture
        if capture and not use_triton(cache.data, impl):
            # The PyTorch attention path reads lengths on the host (`.tolist()`), which a
            # captured graph cannot hold: with the torch kernels on CUDA, decode runs eagerly.
            capture = False
        self.graphs: DecodeGraphs | None = None
        # GPT-OSS and Qwen3.5 decode through PagedAttention only
        plain = not model.args.sinks_or_windows and recurrent is None
        if cuda_graphs and (capture or graphs_capture is False) and plain:
            self.graphs = DecodeGraphs(
                self._logits,
                cache,
                self.scale,
                max_model_len or model.args.max_position_embeddings,
                impl=impl,
                capture=capture,
            )
        self.mirror: DecodeMirror | None = None
        if (
            decode_mirror
            and plain
            and self.graphs is None
            and cache.data.dtype == torch.float32
            and not batch_invariant.enabled()
            and not use_triton(cache.data, impl)
        ):
            self.mirror = DecodeMirror(cache, max_model_len or model.args.max_position_embeddings)
        self.compiled = self._compiled(compile_decode)
        if self.compiled is not None:  # its noise too: the same bits, a fused loop
            self.sampler = Sampler(uniforms=compiled_uniforms())

    def _compiled(self, setting: bool | str | None) -> CompiledDecode | None:
        """The compiled decode step (compiled_decode.py) if the setting, or else the process's
        choice, asks for it and this generator's decode steps run on a mirror (so never under
        ``rl.exact``, where compiled and eager logits differ in their last bits)."""
        mode, decode_steps = process_choice()
        mode = mode if setting is None else setting
        if mode is False:
            return None
        if self.mirror is None:
            if mode is True:  # rl.exact, the Triton kernels, CUDA graphs or a non-fp32 pool
                log.warning("compile_decode: decode steps do not run on the mirror; eager")
            return None
        why = supported(self.model)
        if why is not None:
            if mode is True:
                log.warning("compile_decode: %s; decode steps run eagerly", why)
            return None
        if mode == "auto" and not choose(self.model, self.scale, decode_steps):
            return None
        return CompiledDecode(self.model, self.mirror, self.scale)

    def _logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Logits [T, V] (fp32) of a flat step whose every token is sampled (decode)."""
        hidden = self.model(tokens[None], positions=positions[None], attn=attn, return_hidden=True)[
            0
        ]
        return self.model.output(hidden).float()

    def _decode_logits(self, out: SchedulerOutput) -> torch.Tensor | None:
        if self.graphs is None or not out.is_pure_decode:
            return None
        bs = self.cache.block_size
        chunks = out.chunks
        if self.vision is not None and self.vision.has_images(chunks):
            return None
        rope = (
            self.vision.rope_1d(chunks)
            if self.vision is not None
            else [c.positions[0] for c in chunks]
        )
        return self.graphs.run(
            [c.token_ids[0] for c in chunks],
            rope,
            [c.slot_mapping(bs)[0] for c in chunks],
            [c.seq.block_table for c in chunks],
            [c.end for c in chunks],
        )

    def build_meta(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, PagedMeta]:
        """Flatten the step: tokens [T], positions [T] and the paged metadata."""
        bs = self.cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        ctx: list[int] = []
        for c in out.chunks:
            tokens += c.token_ids
            positions += c.positions
            slots += c.slot_mapping(bs)
            cu.append(len(tokens))
            ctx.append(c.end)
        width = max(len(c.seq.block_table) for c in out.chunks)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in out.chunks]

        def t(x: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=self.device)

        meta = PagedMeta(
            slot_mapping=t(slots, torch.int64),
            block_tables=t(tables),
            cu_seqlens_q=t(cu),
            context_lens=t(ctx),
            max_q_len=max(c.num_tokens for c in out.chunks),
        )
        return t(tokens, torch.long), t(positions, torch.long), meta

    def _mirror_logits(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Logits [N, V] of a pure decode step run on the `DecodeMirror`, or None (not such a step,
        no mirror, or the step outgrew it: its sequences are then forgotten by the mirror)."""
        if self.mirror is None:
            return None
        if out.preempted:
            self.mirror.forget(s.seq_id for s in out.preempted)
        decode = out.is_pure_decode and not (
            self.vision is not None and self.vision.has_images(out.chunks)
        )
        step = self.mirror.plan(out.chunks, not out.block_copies) if decode else None
        if step is None:
            # they get tokens through the pages
            self.mirror.forget(c.seq.seq_id for c in out.chunks)
            return None
        # the KV rows' index; a vision-language model's M-RoPE shifts its RoPE
        rope = step.positions
        if self.vision is not None:
            rope = torch.tensor(
                self.vision.rope_1d(out.chunks), dtype=torch.long, device=rope.device
            )
        if self.compiled is not None:
            logits = self.compiled.logits(step, rope)
            if logits is not None:
                return logits
        return self._logits(step.tokens, rope, MirrorAttention(self.mirror, step, self.scale))

    def _inputs(self, out: SchedulerOutput, positions: torch.Tensor) -> dict:
        """The model's positions (``[1, T]``, or M-RoPE ``[3, 1, T]`` over images) and
        image rows."""
        if self.vision is None:
            return {"positions": positions[None]}
        if not self.vision.has_images(out.chunks):
            rope = torch.tensor(
                self.vision.rope_1d(out.chunks), dtype=torch.long, device=self.device
            )
            return {"positions": rope[None]}
        rope3, images = self.vision.inputs(out.chunks, self.device)
        return {"positions": rope3[:, None], "images": images}

    def _segments(self, out: SchedulerOutput) -> Segments:
        """The step's chunks as linear attention's padded batch (one chunk a row)."""
        lens = [c.num_tokens for c in out.chunks]
        w, starts = max(lens), [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        gather = [[st + min(j, n - 1) for j in range(w)] for st, n in zip(starts, lens)]
        scatter = [k * w + j for k, n in enumerate(lens) for j in range(n)]

        def t(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=self.device)

        return Segments(t(gather), t(scatter), t(lens))

    def _record_routing(self, out: SchedulerOutput) -> None:
        """MoE models: file the experts of the step's tokens (every path runs them in
        chunk order)."""
        if self.routing.blocks:
            self.routing.record([(c.seq.seq_id, p) for c in out.chunks for p in c.positions])

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[int, tuple[int, float, float]]:
        """Execute one step; returns seq_id -> (token, logprob, raw_logprob) for sampled chunks."""
        self.cache.copy_blocks(out.block_copies)
        if self.recurrent is not None:
            self.recurrent.copy_slots(out.state_copies)
        chunks = out.sample_chunks
        logits = self._decode_logits(out)
        if logits is None:
            logits = self._mirror_logits(out)
        if logits is None:
            tokens, positions, meta = self.build_meta(out)
            attn = PagedAttention(self.cache, meta, self.scale, impl=self.impl)
            if self.recurrent is not None:
                attn.segments = self._segments(out)
                attn.linear_state = self.recurrent.step(
                    [c.seq.state_slot for c in out.chunks], [c.start == 0 for c in out.chunks]
                )
            # [T, D]
            hidden = self.model(
                tokens[None], attn=attn, return_hidden=True, **self._inputs(out, positions)
            )[0]
            self._record_routing(out)
            if not chunks:
                return {}
            ends = [i for i, c in enumerate(out.chunks) if c.sample]
            last = meta.cu_seqlens_q[1:][torch.tensor(ends, device=self.device)].long() - 1  # [M]
            logits = self.model.output(hidden[last]).float()  # [M, V]
        else:
            self._record_routing(out)
        keys = [c.step_key(self.default_seed) for c in chunks]
        toks, lps, raws = self.sampler.sample(logits, [c.seq.params for c in chunks], keys)
        if self.agree is not None:
            toks, lps, raws = self.agree(toks, lps, raws)
        # One host sync per step, on purpose: the scheduler needs the tokens.
        rows = zip(toks.tolist(), lps.tolist(), raws.tolist())
        return {c.seq.seq_id: row for c, row in zip(chunks, rows)}
