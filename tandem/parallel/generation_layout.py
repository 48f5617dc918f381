"""The generation layout: a decoder split over a tensor-parallel group of its own.

The rollout's copy of the model is laid out independently of training. A
*generation group* is ``tp`` consecutive ranks; each rank of it holds:

- q/k/v projections (and their biases) and gate/up split by output features, so
  every rank owns ``num_heads / tp`` query heads, ``num_kv_heads / tp`` KV heads
  (its KV pool holds only those) and ``intermediate / tp`` MLP features;
- o and down projections split by input features, their outputs summed over the
  group (`RowParallel`);
- the embedding and LM head split by vocabulary rows (``vocab_parallel``; the
  vocabulary padded to a multiple of ``tp``, `VocabParallelEmbedding` /
  `VocabParallelHead`, whose logits are gathered so every rank samples from the
  whole vocabulary), or whole on every rank;
- norms whole.

The copy is an ordinary `Transformer` built with the local sizes
(`local_args`), its row-parallel and vocabulary modules wrapped afterwards
(`shard_modules`); models/ never sees a process group. Which global region each
parameter takes is `needed_box`, which the reshard (tandem/parallel/reshard.py) fills.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.kernels import batch_invariant
from tandem.kernels.cpu_linear import OneDNNLinear, onednn_linear_available, use_onednn_linears
from tandem.kernels.weight_quant import QuantizedWeight, WeightFormat, quantized_nbytes
from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, apply_lora, is_adapter
from tandem.models.quant_linear import install_quantized, is_target_weight
from tandem.models.transformer import Transformer
from tandem.models.vlm import make_model
from tandem.parallel.ac import clean_fqn
from tandem.parallel.mesh import new_groups
from tandem.parallel.quant_copy import on_arrival, quant_buffers, quant_metrics, tensor_amax
from tandem.parallel.reshard import Box, Resharder, held
from tandem.parallel.tp_modules import RowParallel, VocabParallelEmbedding, VocabParallelHead

HEADROOM = 0.9  # share of a device a phase may fill; the rest: allocator, CUDA context, NCCL

# parameter-name pattern -> the dimension split over the group (None: whole on every rank)
_RULES: list[tuple[re.Pattern[str], int | None]] = [
    (re.compile(r"layers\.\d+\.attention\.w[qkv]\.(weight|bias)$"), 0),
    (re.compile(r"layers\.\d+\.attention\.wo\.weight$"), 1),
    (re.compile(r"layers\.\d+\.feed_forward\.w[13]\.weight$"), 0),
    (re.compile(r"layers\.\d+\.feed_forward\.w2\.weight$"), 1),
    (
        re.compile(r"(layers\.\d+\.(attention_norm|ffn_norm|attention\.[qk]_norm)|norm)\.weight$"),
        None,
    ),
    # mixture of experts: every expert split by its hidden features (TP inside the experts), the
    # router, the shared expert's gate and the routing bias whole; the block's output is summed
    (re.compile(r"layers\.\d+\.moe\.experts\.w[13]$"), 1),
    (re.compile(r"layers\.\d+\.moe\.experts\.w2$"), 2),
    (re.compile(r"layers\.\d+\.moe\.shared_experts\.w[13]\.weight$"), 0),
    (re.compile(r"layers\.\d+\.moe\.shared_experts\.w2\.weight$"), 1),
    (re.compile(r"layers\.\d+\.moe\.(gate\.weight|shared_expert_gate\.weight|expert_bias)$"), None),
    # GPT-OSS's sinks (per query head), o / router / expert biases. Its generation tp > 1 is
    # refused (tandem/rl/config/composes.py: a row-parallel bias would be summed tp times);
    # these rules size it for the planner
    (re.compile(r"layers\.\d+\.attention\.sinks$"), 0),
    (re.compile(r"layers\.\d+\.moe\.experts\.b[13]$"), 1),
    (re.compile(r"layers\.\d+\.(attention\.wo\.bias|moe\.gate\.bias|moe\.experts\.b2)$"), None),
    # a vision-language model's tower: whole on every rank of a group
    (re.compile(r"^visual\."), None),
    # LoRA adapters (tandem/models/lora.py): a column-parallel projection's A whole and B split by
    # its output rows, a row-parallel one's A split by its input features and B whole (its partial
    # sums join the base's before the group's all-reduce); an expert's likewise on its hidden dim
    (
        re.compile(
            r"\.(attention\.w[qkv]|feed_forward\.w[13]|shared_experts\.w[13])\.lora_A\.weight$"
        ),
        None,
    ),
    (
        re.compile(
            r"\.(attention\.w[qkv]|feed_forward\.w[13]|shared_experts\.w[13])\.lora_B\.weight$"
        ),
        0,
    ),
    (re.compile(r"\.(attention\.wo|feed_forward\.w2|shared_experts\.w2)\.lora_A\.weight$"), 1),
    (re.compile(r"\.(attention\.wo|feed_forward\.w2|shared_experts\.w2)\.lora_B\.weight$"), None),
    (re.compile(r"\.moe\.experts\.w[13]_lora_A$"), None),
    (re.compile(r"\.moe\.experts\.w[13]_lora_B$"), 1),
    (re.compile(r"\.moe\.experts\.w2_lora_A$"), 2),
    (re.compile(r"\.moe\.experts\.w2_lora_B$"), None),
]
_VOCAB = re.compile(r"(tok_embeddings|output)\.weight$")


@dataclass(frozen=True)
class GenerationLayout:
    """This rank's place in the generation layout."""

    tp: int = 1
    rank: int = 0  # within the group
    group: dist.ProcessGroup | None = None  # None when tp = 1
    vocab_parallel: bool = True
    leader: int = 0  # the group's first global rank

    @property
    def splits_vocab(self) -> bool:
        return self.tp > 1 and self.vocab_parallel


def make_layout(tp: int, vocab_parallel: bool = True) -> GenerationLayout:
    """Collective (every rank, once): this rank's generation group, ``tp`` consecutive ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp < 1 or world % tp:
        raise ValueError(f"a generation group of {tp} ranks does not divide the {world} ranks")
    me = dist.get_rank() if dist.is_initialized() else 0
    group = new_groups([list(range(i, i + tp)) for i in range(0, world, tp)]) if tp > 1 else None
    return GenerationLayout(
        tp=tp, rank=me % tp, group=group, vocab_parallel=vocab_parallel, leader=me - me % tp
    )


def from_leader(obj: Any, layout: GenerationLayout) -> Any:
    """Collective over the generation group: the leader's ``obj`` (any picklable value) on every
    rank; what the others pass is ignored. ``layout.tp = 1``: ``obj`` itself, no collective."""
    if layout.tp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=layout.leader, group=layout.group)
    return box[0]


def check_divisible(args: ModelArgs, tp: int) -> str | None:
    """Why ``args`` cannot be split ``tp`` ways (None: it can)."""
    sizes = [
        ("num_heads", args.num_heads),
        ("num_kv_heads", args.num_kv_heads),
        ("intermediate_size", args.intermediate_size),
    ]
    if getattr(args, "num_experts", 0):
        sizes += [
            ("moe_intermediate_size", args.moe_intermediate_size),
            ("shared_expert_intermediate_size", args.shared_expert_intermediate_size),
        ]
    for what, n in sizes:
        if n % tp:
            return f"the model's {what} {n} is not divisible by {tp}"
    return None


def vocab_rows(args: ModelArgs, tp: int) -> int:
    """Rows of one rank's vocabulary shard (the vocabulary padded to a multiple of ``tp``)."""
    return -(-args.vocab_size // tp)


def local_args(args: ModelArgs, layout: GenerationLayout) -> ModelArgs:
    """The sizes of one rank's shard, as a model of its own."""
    if layout.tp == 1:
        return args
    reason = check_divisible(args, layout.tp)
    if reason:
        raise ValueError(reason)
    moe = {}
    if getattr(args, "num_experts", 0):
        moe = {
            "moe_intermediate_size": args.moe_intermediate_size // layout.tp,
            "shared_expert_intermediate_size": args.shared_expert_intermediate_size // layout.tp,
        }
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // layout.tp,
        num_kv_heads=args.num_kv_heads // layout.tp,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size // layout.tp,
        vocab_size=vocab_rows(args, layout.tp) if layout.splits_vocab else args.vocab_size,
        **moe,
    )


def split_dim(name: str, layout: GenerationLayout) -> int | None:
    """The dimension of parameter ``name`` split over the group (None: whole on every rank)."""
    if _VOCAB.search(name):
        return 0 if layout.splits_vocab else None
    for pattern, dim in _RULES:
        if pattern.search(name):
            return dim
    raise KeyError(f"no generation-layout rule for parameter {name!r}")


def needed_box(
    name: str, shape: tuple[int, ...], layout: GenerationLayout
) -> tuple[Box, tuple[int, ...]]:
    """The global region of ``name`` this rank's shard holds, and the shard's local shape."""
    dim = split_dim(name, layout) if layout.tp > 1 else None
    if dim is None:
        return Box.whole(shape), shape
    n = shape[dim]
    rows = -(-n // layout.tp)  # only the vocabulary is ever uneven (padded)
    start = min(layout.rank * rows, n)
    size = min(rows, n - start)
    offset = tuple(start if d == dim else 0 for d in range(len(shape)))
    region = tuple(size if d == dim else s for d, s in enumerate(shape))
    local = tuple(rows if d == dim else s for d, s in enumerate(shape))
    return Box(offset, region), local


def shard_bytes(
    args: ModelArgs,
    layout: GenerationLayout,
    dtype: torch.dtype,
    lora: LoraSpec | None = None,
    weight_format: WeightFormat | None = None,
) -> int:
    """Bytes of one rank's generation shard (tied embeddings counted once; with ``lora``,
    adapters too; with ``weight_format``, the projections in it)."""
    with torch.device("meta"):
        model = make_model(args)
        if lora is not None:
            apply_lora(model, lora)
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, p in state_tensors(model).items():
        _, local = needed_box(name, tuple(p.shape), layout)
        if weight_format is not None and is_target_weight(name):
            total += quantized_nbytes((local[0], local[1]), weight_format)
        else:
            total += math.prod(local) * elem
    return total


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a generation copy needs: parameters (a tied one once) and persistent buffers."""
    keys = set(model.state_dict())
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n in keys})
    return out


def shard_modules(model: nn.Module, args: ModelArgs, layout: GenerationLayout) -> None:
    """Wrap a shard-sized `Transformer`'s row-parallel and vocabulary modules, in place
    (after its weights are loaded and its inference layout is applied: parameter names
    change under the wrappers)."""
    if layout.tp == 1:
        return
    assert layout.group is not None
    for block in model.layers.values():
        block.attention.wo = RowParallel(block.attention.wo, layout.group)
        if hasattr(block, "moe"):  # routed and shared experts' partial sums, added once
            block.moe = RowParallel(block.moe, layout.group)
        else:
            block.feed_forward.w2 = RowParallel(block.feed_forward.w2, layout.group)
    if layout.splits_vocab:
        rows = vocab_rows(args, layout.tp)
        model.tok_embeddings = VocabParallelEmbedding(
            model.tok_embeddings.weight, layout.rank * rows, layout.group
        )
        model.output = VocabParallelHead(
            model.output.weight, args.vocab_size, layout.group, layout.tp
        )


def auto_tp(
    args: ModelArgs,
    shard_bytes_of: Callable[[int], float],
    *,
    world: int,
    devices_per_node: int,
    device_bytes: float,
    resident_bytes: float,
    kv_bytes: float,
) -> int:
    """The generation degree ``rollout.tp = 0`` (auto) stands for, on one kind of device.

    The smallest ``g`` that divides both ``world`` and ``devices_per_node`` and the model's
    heads and MLP, whose shard (``shard_bytes_of(g)``), beside ``resident_bytes`` (what training
    keeps on the device) and the ``kv_bytes`` pool, fits in `HEADROOM` of ``device_bytes``; the
    largest such ``g`` when none fits. A group is ``g`` consecutive ranks, so ``g`` dividing
    ``devices_per_node`` keeps it inside a node: its two all-reduces per layer never cross the
    network. The run and the planner (``train.py --plan``) both call this. GPT-OSS, DeepSeek-V3
    and Qwen3.5 get 1: their generation tp is refused yet (tandem/rl/config/composes.py)."""
    if args.model_type in ("gpt_oss", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text"):
        return 1
    bound = math.gcd(world, devices_per_node)
    degrees = [
        g for g in range(1, bound + 1) if bound % g == 0 and check_divisible(args, g) is None
    ]
    room = HEADROOM * device_bytes - resident_bytes - kv_bytes
    return next((g for g in degrees if shard_bytes_of(g) <= room), degrees[-1])


class GenerationCopy:
    """A model's copy in the generation layout, filled from its training shards.

    ``module``: the trained parameters under the whole model's names (FSDP2 / TP DTensors, or
    this rank's pipeline stages). `build` moves, bucket by bucket, only the regions this rank's
    shard needs, in the generation dtype (tandem/parallel/reshard.py), so no rank holds the
    whole model unless its shard is the whole model (``layout.tp = 1``). The move's plan is
    made at the first build (collective) and kept: the layouts do not change during a run.
    With LoRA adapters (``lora``) the copy runs them unmerged, like the update: its frozen base
    moves once, at the first build, and stays; every later build moves only the adapters and
    checks them against the trainer's by an exact checksum (a mismatch is an error).

    ``keep``: name prefixes of parameters that never change during the run (a frozen vision
    tower, ``"visual."``): the generation copy and the policy have the same names, so this
    explicit map is all the reshard needs; they move at the first build only and their copies
    are kept for the next rollouts (``reshard/kept_gb``; the only rollout memory the update
    phase still holds), so later builds move only what training changed.

    ``weight_format`` (rollout.weight_dtype): low-bit projections, tandem/parallel/quant_copy.py.
    """

    def __init__(
        self,
        module: nn.Module,
        args: ModelArgs,
        layout: GenerationLayout,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        bucket_bytes: int = 256 << 20,
        keep: tuple[str, ...] = (),
        cpu_onednn: bool = False,
        lora: LoraSpec | None = None,
        weight_format: WeightFormat | None = None,
    ) -> None:
        self.module, self.args, self.layout, self.device = module, args, layout, device
        self.weight_format, self._arrived = weight_format, {}  # what `_quantizing` passes on
        self.cpu_onednn = cpu_onednn  # rollout.cpu_onednn: see `inference_layout`
        self.local = local_args(args, layout)
        self.lora = lora  # adapters: the copy is kept, and refilled with them alone (`_refill`)
        with torch.device("meta"):
            meta = make_model(args)
            if lora is not None:
                apply_lora(meta, lora)
        # tied: counted once
        self.shapes = {name: tuple(t.shape) for name, t in state_tensors(meta).items()}
        first = next(iter(module.parameters()), None)
        self.dtype = dtype or (first.dtype if first is not None else torch.float32)
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        # the kept names' copies, after the first build
        self._kept_state: dict[str, torch.Tensor] = {}
        # the first build's plan and, with ``keep``, the later builds'
        self._plans: dict[bool, Resharder] = {}
        self._adapter_plan: Resharder | None = None
        # LoRA: the copy and its adapters
        self._kept: tuple[Transformer, dict[str, torch.Tensor]] | None = None

    def _moving(self) -> dict[str, tuple[int, ...]]:
        """The names this build moves: all at first, then all but the kept ones."""
        later = bool(self._kept_state)
        return {
            n: shape for n, shape in self.shapes.items() if not (later and n.startswith(self.keep))
        }

    def _held(self) -> dict[str, tuple[torch.Tensor, Box]]:
        out = {}
        for name, p in [*self.module.named_parameters(), *self.module.named_buffers()]:
            name = clean_fqn(name)
            if name in self.shapes:  # a pipeline rank's second copy of a tied head is not moved
                out[name] = held(p.detach())
        return out

    def build(
        self, *, inference: bool = True, probe: Callable[[], None] | None = None
    ) -> tuple[Transformer, dict[str, float]]:
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
        qweights: dict[str, QuantizedWeight] = {}
        state, stats = self._move(moving, srcs, None, probe, self._quantizing(qweights, srcs))
        del srcs
        if self.keep and not later:
            self._kept_state = {n: t for n, t in state.items() if n.startswith(self.keep)}
        state.update(self._kept_state)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        nbytes += sum(q.nbytes() for q in qweights.values())
        kept_bytes = sum(t.numel() * t.element_size() for t in self._kept_state.values())
        if self.args.tie_word_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        with torch.device("meta"):
            gen = make_model(self.local)
            if self.lora is not None:
                apply_lora(gen, self.lora)
        gen.quant_linears = install_quantized(gen, qweights)
        state.update(quant_buffers(gen.quant_linears))  # already real: loaded as they are
        gen.load_state_dict(state, assign=True, strict=True)
        gen.tie_weights()
        gen.rope.to_empty(device=self.device)  # materialise and recompute the RoPE table
        if hasattr(gen, "visual"):
            gen.visual.reset_rope(self.device)
        gen.requires_grad_(False).eval()
        # fused projections would fold the adapters' inputs, or the low-bit blocks
        if inference and self.lora is None and not gen.quant_linears:
            inference_layout(gen, self.cpu_onednn)
        self._copy_bytes = nbytes
        metrics = _reshard_metrics(stats, nbytes, kept_bytes)
        metrics.update(quant_metrics(gen.quant_linears, self.dtype))
        if self.lora is not None:  # before shard_modules renames
            adapters = {n: p for n, p in gen.named_parameters() if is_adapter(n)}
            self._kept = (gen, adapters)
            metrics.update(self._check(adapter_srcs, adapters))
        gen.refill_views = gen.unfused_views()  # before the wrappers rename the shard's modules
        shard_modules(gen, self.args, self.layout)
        return gen, metrics

    def refill(
        self, gen: Transformer, *, probe: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """Collective: the policy's current weights into ``gen`` (a model `build` made), in place:
        its tensors, and whatever holds them (a generator's captured graphs, its hooks), stay.
        With adapters: the kept copy's adapters alone (`_refill`); kept names (``keep``) stay."""
        if self._kept is not None:
            return self._refill(probe)[1]
        moving = self._moving()
        srcs = {n: src for n, src in self._held().items() if n in moving}
        quantizing = self._quantizing(gen.quant_linears, srcs)
        state, stats = self._move(moving, srcs, gen.refill_views, probe, quantizing)
        for m in gen.modules():  # oneDNN's blocked copies are of the old weights
            if isinstance(m, OneDNNLinear) and m.packed is not None:
                m.pack()
        kept = sum(t.numel() * t.element_size() for t in self._kept_state.values())
        moved = sum(t.numel() * t.element_size() for t in state.values())
        if gen.quant_linears:  # every tensor went through ``done``: the size `build` measured
            quant = quant_metrics(gen.quant_linears, self.dtype)
            return _reshard_metrics(stats, self._copy_bytes, kept) | quant
        return _reshard_metrics(stats, moved + kept, kept)  # the copy's size, as `build` reports

    def _quantizing(self, sink: dict[str, Any], srcs: dict) -> Callable[..., None] | None:
        """Collective with a weight format: the reshard's ``done`` (`on_arrival`); else None."""
        if (fmt := self.weight_format) is None:
            return None
        amax = tensor_amax(fmt, list(self.shapes), srcs, self.dtype)
        return on_arrival(fmt, sink, self._arrived, amax)

    def _move(
        self,
        moving: dict[str, tuple[int, ...]],
        srcs: dict[str, tuple[torch.Tensor, Box]],
        into: dict[str, torch.Tensor] | None,
        probe: Callable[[], None] | None,
        done: Callable[[str, torch.Tensor], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Collective: the move of ``moving`` (planned at its first call: one plan for the first
        build, one for the later ones without the kept names), into new tensors or ``into``'s
        (``done``: `_quantizing`'s; what it keeps is returned with the rest)."""
        later = bool(self._kept_state)
        if later not in self._plans:
            self._plans[later] = self._make_plans(moving, srcs)
        state, stats = self._plans[later].run(
            {n: t for n, (t, _) in srcs.items()},
            self.dtype,
            self.device,
            probe=probe,
            into=into,
            done=done,
        )
        state.update(self._arrived)
        self._arrived.clear()
        return state, stats

    def _make_plans(
        self, moving: dict[str, tuple[int, ...]], srcs: dict[str, tuple[torch.Tensor, Box]]
    ) -> Resharder:
        """The reshard plan of ``moving``; with adapters, also the plan of the adapters alone."""
        needs = self._needs(moving)
        boxes = {n: b for n, (_, b) in srcs.items()}
        if self.lora is not None:  # the adapters alone, for every later build
            names = [n for n in moving if is_adapter(n)]
            self._adapter_plan = self._resharder(
                {n: self.shapes[n] for n in names},
                {n: boxes[n] for n in names if n in boxes},
                {n: needs[n] for n in names if n in needs},
            )
        return self._resharder(moving, boxes, needs)

    def _needs(self, moving: dict[str, tuple[int, ...]]) -> dict[str, tuple[Box, tuple[int, ...]]]:
        """What this rank's shard needs of each moving tensor."""
        return {n: needed_box(n, shape, self.layout) for n, shape in moving.items()}

    def _resharder(self, shapes: dict, boxes: dict, needs: dict) -> Resharder:
        """A move plan over this copy's group (the world's)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return Resharder(shapes, boxes, needs, elem, bucket_bytes=self.bucket_bytes)

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

    def _check(
        self, srcs: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """Collective: the copy's adapters against the trainer's (exact checksum); RuntimeError if
        any differ."""
        assert self._adapter_plan is not None
        t0 = time.monotonic()
        total, wrong = self._adapter_plan.verify(srcs, adapters, self.dtype)
        if wrong:
            raise RuntimeError(
                f"generation copy: adapters {wrong[:3]} differ from the trainer's "
                f"after the refill ({len(wrong)} tensors; checksum)"
            )
        return {"lora/adapter_checksum": float(total), "lora/check_seconds": time.monotonic() - t0}


def _reshard_metrics(stats: Any, nbytes: int, kept_bytes: int = 0) -> dict[str, float]:
    return {
        "reshard/seconds": stats.seconds,
        "reshard/gb": nbytes / 1e9,
        "reshard/kept_gb": kept_bytes / 1e9,
        "reshard/sent_gb": stats.bytes_sent / 1e9,
        "reshard/collectives": float(stats.collectives),
        "reshard/buffer_peak_gb": stats.peak_buffer_bytes / 1e9,
    }


def inference_layout(model: Transformer, cpu_onednn: bool = False) -> bool:
    """The generation copy's layout, in place; returns whether it changed anything.

    On CUDA: q/k/v and gate/up fused into one product each (`Transformer.fuse_projections`;
    measured faster, docs/performance.md). On the CPU the copy keeps the training layout unless
    ``cpu_onednn`` (``rollout.cpu_onednn``): then, in fp32 where PyTorch has oneDNN, fused and
    every linear on oneDNN with a prepacked weight (`tandem.kernels.cpu_linear`); it won on one
    CPU and lost on another, and a timing-chosen path would make two runs of one config sample
    differently, so it is a setting, off by default. Under `batch_invariant` (``rl.exact``) the
    copy keeps the update's own unfused aten linears."""
    weight = next(model.parameters(), None)
    if weight is None or batch_invariant.enabled():
        return False
    if weight.device.type != "cpu":  # an accelerator
        model.fuse_projections()
        return True
    if (
        not cpu_onednn
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not onednn_linear_available()
    ):
        return False
    model.fuse_projections()
    use_onednn_linears(model)
    return True
