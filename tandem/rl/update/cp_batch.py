"""The update's micro-batches under context parallelism: each cp rank runs its share of the row.

The cp ranks of a data-parallel rank hold the same samples, so they pack the same
micro-batches. Each takes its share of the packed row (tandem/parallel/cp.py: contiguous
for Ulysses, zig-zag for the ring) and runs the policy, the reference, the old policy or
the critic on it: every per-token quantity (hidden states, log-probs and entropy through
the same fused head as cp = 1, so no ``[S, V]`` logits; values) is computed on the local
tokens only. The ``[K_r]`` values of the completion tokens a rank holds are then placed
in the micro-batch's ``[K]`` completion vector, zeros where another rank holds the token,
and summed over cp: K floats per micro-batch, not activations. Every cp rank then holds
whole sequences' values and computes the same loss with the registered functions,
unchanged: GSPO's sequence ratio, the length normalisations and the aggregations are
sums over whole sequences, so they equal cp = 1's by construction. The sum's backward is
the identity, so each rank's backward covers its own tokens' terms, and FSDP2 over
``dp_shard x cp`` adds the shares (the loss is scaled by ``dp x cp``).

`RowShare` does the same for the right-padded ``[B, S]`` batches of the sft, dpo and
reward_model recipes: per-row sums (a sequence's log-prob) and single columns (a reward
model's last-token score) of the local tokens, summed over cp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tandem.kernels.logprobs import token_logprobs_entropy
from tandem.models.attention import AttentionBackend
from tandem.parallel.cp import ContextParallel, ContextSplitError
from tandem.parallel.loss import all_reduce_sum

if TYPE_CHECKING:
    from tandem.rl.update.packing import MicroBatch


@dataclass
class LocalRow:
    """This rank's share of a micro-batch: inputs ``[B, S/cp]``, its guarded attention backend,
    and the completion tokens it holds (``index``: flat local positions, ``where``: their
    places among the micro-batch's K completion tokens)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    attn: AttentionBackend
    index: torch.Tensor  # [K_r]
    where: torch.Tensor  # [K_r]
    guarded: Any  # the split's backend (``attn`` itself, or inside the FP8 K/V rounding)

    def check_calls(self, model: nn.Module) -> None:
        """Every layer's attention went through the guarded backend (none was bypassed)."""
        _check_calls(self.guarded, len(model.layers))


def _check_calls(attn: Any, layers: int) -> None:
    if attn.guard.calls != layers:
        raise ContextSplitError(
            f"context parallelism: {attn.guard.calls} of the model's {layers} "
            "attention layers ran through the split's backend"
        )


def local_row(cp: ContextParallel, mb: MicroBatch, wrapped: bool = True) -> LocalRow:
    """``mb``'s share for this cp rank. ``wrapped`` (the policy's forwards, not the critic's):
    with the micro-batch's ``kv_wrap`` (FP8 K/V rounding) outside the split's backend, so K and
    V are rounded on this rank's positions, all its heads, before the all-to-all or the ring
    moves them; the rounding is per token and head, so it is the unsplit row's."""
    s = mb.tokens.shape[1]
    split = cp.split(s)
    guarded = cp.attention(split, mb.attention(wrapped=False), mb.doc_ids, mb.branch_ids)
    attn = mb.kv_wrap(guarded) if wrapped and mb.kv_wrap is not None else guarded
    local = split.local_columns(mb.tokens.device)  # [S] local column or -1
    row, col = mb.comp_index // s, mb.comp_index % s
    lc = local[col]
    where = (lc >= 0).nonzero()[:, 0]
    index = row[where] * split.local_len + lc[where]
    return LocalRow(split.shard(mb.tokens), split.shard(mb.positions), attn, index, where, guarded)


def cp_token_logprobs(
    model: nn.Module, mb: MicroBatch, cp: ContextParallel, *, with_entropy: bool, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`tandem.rl.update.loss.token_logprobs` under cp: the same ``[K]`` values on every cp rank."""
    r = local_row(cp, mb)
    targets = mb.completion_targets().index_select(0, r.where)

    def head(h: torch.Tensor, weight: torch.Tensor) -> Any:
        flat = h.reshape(-1, h.shape[-1]).index_select(0, r.index)  # [K_r, D]
        return token_logprobs_entropy(
            flat, weight, targets, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )

    logp, ent = model(r.tokens, positions=r.positions, attn=r.attn, head=head)
    r.check_calls(model)
    k = mb.comp_index.numel()
    return cp.sum_values(logp, r.where, k), (
        cp.sum_values(ent, r.where, k) if ent is not None else None
    )


def cp_values(model: nn.Module, mb: MicroBatch, cp: ContextParallel) -> torch.Tensor:
    """A scalar-head model's (the critic's) ``[K]`` values at the completion tokens under cp."""
    r = local_row(cp, mb, wrapped=False)  # not the policy's FP8 K/V rounding
    v = model(r.tokens, positions=r.positions, attn=r.attn).reshape(-1).index_select(0, r.index)
    r.check_calls(model)
    return cp.sum_values(v, r.where, mb.comp_index.numel())


class RowShare:
    """This cp rank's share of a right-padded ``[B, S]`` batch: the sft, dpo and reward_model
    recipes' rows, split as the RL update splits its packed rows.

    The row is padded on the right to the split's granularity (pad values are the caller's:
    they sit after every real token, so causal attention keeps them out of it); `take` gives
    this rank's columns of a ``[B, S]`` input, `attn` is the split's guarded backend around
    ``inner(doc_ids)`` (the unsplit row's backend, built on the padded ids; padding id -1),
    and `row_sums` / `at_columns` turn per-row values of the local tokens into the whole rows'
    ones on every cp rank (summed over cp with an identity backward, as in `cp_token_logprobs`).
    ``cp`` None (cp = 1): the batch itself, the inner backend, no collective."""

    def __init__(
        self,
        cp: ContextParallel | None,
        doc_ids: torch.Tensor,
        inner: Callable[[torch.Tensor], AttentionBackend],
    ) -> None:
        self.cp = cp
        if cp is None:
            self.split, self.attn = None, inner(doc_ids)
            return
        g = cp.granularity
        self.seq_len = -(-doc_ids.shape[1] // g) * g
        docs = self._pad(doc_ids, -1)  # [B, S'] with S' a multiple of the granularity
        self.split = cp.split(self.seq_len)
        self.attn = cp.attention(self.split, inner(docs), docs)

    def _pad(self, x: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(x, (0, self.seq_len - x.shape[1]), value=value)

    def take(self, x: torch.Tensor, pad: int) -> torch.Tensor:
        """``x [B, S]`` -> this rank's ``[B, S' / cp]`` (``x`` itself at cp = 1)."""
        return x if self.split is None else self.split.shard(self._pad(x, pad), 1)

    def row_sums(self, local: torch.Tensor) -> torch.Tensor:
        """``[B]`` sums of this rank's tokens -> the whole rows' sums, alike on every cp rank."""
        return local if self.cp is None else all_reduce_sum(local, self.cp.group)

    def at_columns(self, local: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``local [B, S' / cp]`` values, ``cols [B]`` global columns -> ``[B]`` the value at each
        row's column, from whichever rank holds it."""
        if self.split is None:
            return local.gather(1, cols[:, None]).squeeze(1)
        lc = self.split.local_columns(local.device)[cols]  # [B]: local column or -1
        picked = local.gather(1, lc.clamp(min=0)[:, None]).squeeze(1)
        return self.row_sums(torch.where(lc >= 0, picked, 0.0))

    def check_calls(self, model: nn.Module) -> None:
        """After a forward: every attention layer of ``model`` went through the split's backend
        (nothing at cp = 1)."""
        if self.split is not None:
            _check_calls(self.attn, len(model.layers))
