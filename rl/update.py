"""The update phase: rollouts -> packed micro-batches -> token log-probs -> loss.

Every micro-batch packs whole sequences (prompt + completion) into one row of
at most ``micro_batch_tokens`` tokens, with per-document positions and a
block-diagonal mask, so no compute is spent on padding. Each rank runs the
same number of micro-batches (empty ones are padded in), because FSDP2's
collectives must match across ranks. Losses use the global denominators of
the optimizer step, so the update is the same however the batch is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.attention import DocumentAttention
from rl.algorithms import KL_ESTIMATORS, PolicyLossInput
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


@dataclass
class LossInputs:
    """The rank's rollout batch as completion-aligned [N, T] tensors for the loss."""

    mask: torch.Tensor  # [N, T] 1 where the policy sampled the token
    old_logp: torch.Tensor  # [N, T] policy before this update (update layout)
    advantages: torch.Tensor  # [N, T]
    gen_logp: torch.Tensor  # [N, T] generator log-probs (truncated IS)
    ref_logp: torch.Tensor | None  # [N, T] reference policy (KL)


@dataclass
class LossSpec:
    """Registered pieces (already looked up) and coefficients of the policy loss."""

    policy_loss: Callable
    policy_cfg: Any
    aggregation: Callable
    kl_estimator: Callable | None  # loss-term KL (None: off)
    kl_coef: float
    entropy_coef: float


def micro_batch_loss(model: nn.Module, mb: MicroBatch, inp: LossInputs, spec: LossSpec, norm: Any,
                     width: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated loss of one micro-batch (its share of the step's global loss) and token sums."""
    logp_l, ent_l = token_logprobs(model, mb, with_entropy=True)
    if not mb.rows:  # padding micro-batch: keeps collectives in step, no gradient signal
        return logp_l.sum() * 0.0, {}
    rows = mb.rows
    logp, ent = scatter_rows(logp_l, mb, width), scatter_rows(ent_l, mb, width)  # [n, T]
    m = inp.mask[rows]
    out = spec.policy_loss(PolicyLossInput(logp=logp, old_logp=inp.old_logp[rows], advantages=inp.advantages[rows],
                                           mask=m, gen_logp=inp.gen_logp[rows]), spec.policy_cfg)
    tok_loss = out.loss
    kl = None
    if inp.ref_logp is not None:
        kl = KL_ESTIMATORS.get("k3")(logp.detach(), inp.ref_logp[rows])  # reported KL
        if spec.kl_estimator is not None:
            tok_loss = tok_loss + spec.kl_coef * spec.kl_estimator(logp, inp.ref_logp[rows])
    if spec.entropy_coef:
        tok_loss = tok_loss - spec.entropy_coef * ent
    loss = spec.aggregation(tok_loss, m, norm)
    with torch.no_grad():
        sums = {"clipped": (out.metrics["clipped"].float() * m).sum(), "entropy": (ent * m).sum(),
                "kl": (kl * m).sum() if kl is not None else m.new_zeros(()), "tokens": m.sum()}
    return loss, sums
