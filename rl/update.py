"""The update phase: rollouts -> packed micro-batches -> token log-probs -> loss.

Every micro-batch packs whole sequences (prompt + completion) into one row of
at most ``micro_batch_tokens`` tokens, with per-document positions and a
block-diagonal mask, so no compute is spent on padding. Each rank runs the
same number of micro-batches (empty ones are padded in), because FSDP2's
collectives must match across ranks. Losses use the global denominators of
the optimizer step, so the update is the same however the batch is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.attention import DocumentAttention
from rl.rollout_types import RolloutSample


@dataclass
class MicroBatch:
    rows: list[int]  # sample indices (into the rank's sample list) in this micro-batch
    tokens: torch.Tensor  # [1, L]
    positions: torch.Tensor  # [1, L]
    doc_ids: torch.Tensor  # [1, L]
    targets: torch.Tensor  # [1, L] next-token ids (0 where unused)
    offsets: list[tuple[int, int]]  # per row: (first logit position of the completion, completion length)


def pack_micro_batches(samples: list[RolloutSample], indices: list[int], budget: int,
                       device: torch.device) -> list[MicroBatch]:
    """Greedy packing in order; a sequence longer than the budget gets a micro-batch of its own."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in indices:
        n = len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return [_build(samples, g, device) for g in groups]


def _build(samples: list[RolloutSample], rows: list[int], device: torch.device) -> MicroBatch:
    toks: list[int] = []
    pos: list[int] = []
    docs: list[int] = []
    tgts: list[int] = []
    offsets = []
    for d, i in enumerate(rows):
        s = samples[i]
        seq = s.prompt_ids + s.completion_ids
        n = len(seq) - 1
        offsets.append((len(toks) + len(s.prompt_ids) - 1, len(s.completion_ids)))
        toks += seq[:-1]
        tgts += seq[1:]
        pos += range(n)
        docs += [d] * n

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor([x], dtype=torch.long, device=device)

    return MicroBatch(rows, t(toks), t(pos), t(docs), t(tgts), offsets)


def empty_micro_batch(device: torch.device) -> MicroBatch:
    """A one-token stand-in so every rank runs the same number of forwards."""
    z = torch.zeros(1, 1, dtype=torch.long, device=device)
    return MicroBatch([], z, z, z, z, [])


def sync_micro_batch_count(mbs: list[MicroBatch], device: torch.device) -> list[MicroBatch]:
    n = torch.tensor([len(mbs)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return mbs + [empty_micro_batch(device) for _ in range(int(n.item()) - len(mbs))]


def token_logprobs(model: nn.Module, mb: MicroBatch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log p(target) [L] and entropy [L] (fp32) from one forward."""
    logits = model(mb.tokens, positions=mb.positions, attn=DocumentAttention(mb.doc_ids))[0].float()  # [L, V]
    logp = -F.cross_entropy(logits, mb.targets[0], reduction="none")  # [L]
    ent = None
    if with_entropy:
        lse = torch.logsumexp(logits, dim=-1)
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def scatter_rows(values: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """[L] per-position values -> [len(rows), width] completion-aligned (zeros past the end)."""
    out = values.new_zeros(len(mb.rows), width)
    for r, (start, n) in enumerate(mb.offsets):
        out[r, :n] = values[start:start + n]
    return out


@torch.no_grad()
def recompute_logprobs(model: nn.Module, samples: list[RolloutSample], mbs: list[MicroBatch], width: int,
                       device: torch.device) -> torch.Tensor:
    """Log-probs of every completion token under ``model`` [N, width] (old / reference)."""
    out = torch.zeros(len(samples), width, device=device)
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, with_entropy=False)
        if mb.rows:
            out[mb.rows] = scatter_rows(logp, mb, width)
    return out


def completion_tensors(samples: list[RolloutSample], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss mask [N, T] float, generator log-probs [N, T], T) right-padded."""
    width = max([len(s.completion_ids) for s in samples] + [1])
    mask = torch.zeros(len(samples), width, device=device)
    gen = torch.zeros(len(samples), width, device=device)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        gen[i, :n] = torch.tensor(s.gen_logprobs, dtype=torch.float32)
    return mask, gen, width
