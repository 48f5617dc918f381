"""The tensor-parallel modules of a generation copy (`tandem.parallel.generation_layout`
wraps a shard-sized model's layers in them): a row-parallel linear and a vocabulary-parallel
embedding and LM head, each one collective over the generation group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
