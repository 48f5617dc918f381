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
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, apply_lora
from tandem.models.vlm import make_model
from tandem.parallel.mesh import new_groups
from tandem.parallel.reshard import Box

# parameter-name pattern -> the dimension split over the group (None: whole on every rank)
_RULES: list[tuple[re.Pattern[str], int | None]] = [
    (re.compile(r"layers\.\d+\.attention\.w[qkv]\.(weight|bias)$"), 0),
    (re.compile(r"layers\.\d+\.attention\.wo\.weight$"), 1),
    (re.compile(r"layers\.\d+\.feed_forward\.w[13]\.weight$"), 0),
    (re.compile(r"layers\.\d+\.feed_forward\.w2\.weight$"), 1),
    (re.compile(r"(layers\.\d+\.(attention_norm|ffn_norm|attention\.[qk]_norm)|norm)\.weight$"), None),
    # mixture of experts: every expert split by its hidden features (TP inside the experts), the
    # router, the shared expert's gate and the routing bias whole; the block's output is summed
    (re.compile(r"layers\.\d+\.moe\.experts\.w[13]$"), 1),
    (re.compile(r"layers\.\d+\.moe\.experts\.w2$"), 2),
    (re.compile(r"layers\.\d+\.moe\.shared_experts\.w[13]\.weight$"), 0),
    (re.compile(r"layers\.\d+\.moe\.shared_experts\.w2\.weight$"), 1),
    (re.compile(r"layers\.\d+\.moe\.(gate\.weight|shared_expert_gate\.weight|expert_bias)$"), None),
    (re.compile(r"^visual\."), None),  # a vision-language model's tower: whole on every rank of a group
    # LoRA adapters (tandem/models/lora.py): a column-parallel projection's A whole and B split by its
    # output rows, a row-parallel one's A split by its input features and B whole (its partial
    # sums join the base's before the group's all-reduce); an expert's likewise on its hidden dim
    (re.compile(r"\.(attention\.w[qkv]|feed_forward\.w[13]|shared_experts\.w[13])\.lora_A\.weight$"), None),
    (re.compile(r"\.(attention\.w[qkv]|feed_forward\.w[13]|shared_experts\.w[13])\.lora_B\.weight$"), 0),
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
    return GenerationLayout(tp=tp, rank=me % tp, group=group, vocab_parallel=vocab_parallel, leader=me - me % tp)


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
    sizes = [("num_heads", args.num_heads), ("num_kv_heads", args.num_kv_heads),
             ("intermediate_size", args.intermediate_size)]
    if getattr(args, "num_experts", 0):
        sizes += [("moe_intermediate_size", args.moe_intermediate_size),
                  ("shared_expert_intermediate_size", args.shared_expert_intermediate_size)]
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
        moe = {"moe_intermediate_size": args.moe_intermediate_size // layout.tp,
               "shared_expert_intermediate_size": args.shared_expert_intermediate_size // layout.tp}
    return dataclasses.replace(
        args, num_heads=args.num_heads // layout.tp, num_kv_heads=args.num_kv_heads // layout.tp,
        head_dim=args.head_dim, intermediate_size=args.intermediate_size // layout.tp,
        vocab_size=vocab_rows(args, layout.tp) if layout.splits_vocab else args.vocab_size, **moe)


def split_dim(name: str, layout: GenerationLayout) -> int | None:
    """The dimension of parameter ``name`` split over the group (None: whole on every rank)."""
    if _VOCAB.search(name):
        return 0 if layout.splits_vocab else None
    for pattern, dim in _RULES:
        if pattern.search(name):
            return dim
    raise KeyError(f"no generation-layout rule for parameter {name!r}")


def needed_box(name: str, shape: tuple[int, ...], layout: GenerationLayout) -> tuple[Box, tuple[int, ...]]:
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


def shard_bytes(args: ModelArgs, layout: GenerationLayout, dtype: torch.dtype, lora: LoraSpec | None = None) -> int:
    """Bytes of one rank's generation shard (tied embeddings counted once; with ``lora``, adapters too)."""
    with torch.device("meta"):
        model = make_model(args)
        if lora is not None:
            apply_lora(model, lora)
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, p in state_tensors(model).items():
        _, local = needed_box(name, tuple(p.shape), layout)
        n = 1
        for s in local:
            n *= s
        total += n * elem
    return total


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a generation copy needs: parameters (a tied one once) and persistent buffers."""
    keys = set(model.state_dict())
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n in keys})
    return out


class RowParallel(nn.Module):
    """A linear layer over a slice of its input features; outputs summed over the group."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + rows)`` of the vocabulary; lookups summed over the group."""

    def __init__(self, weight: nn.Parameter, start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.start, self.group = weight, start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """LM head over one vocabulary shard; the logits of all shards gathered (``[..., vocab]``)."""

    def __init__(self, weight: nn.Parameter, vocab: int, group: dist.ProcessGroup, tp: int) -> None:
        super().__init__()
        self.weight, self.vocab, self.group, self.tp = weight, vocab, group, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


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
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, layout.rank * rows, layout.group)
        model.output = VocabParallelHead(model.output.weight, args.vocab_size, layout.group, layout.tp)
