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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from tandem.kernels.logprobs import token_logprobs_entropy
from tandem.models.attention import AttentionBackend
from tandem.parallel.cp import ContextParallel, ContextSplitError

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

    def check_calls(self, model: nn.Module) -> None:
        """Every layer's attention went through the guarded backend (none was bypassed)."""
        layers = len(model.layers)
        if self.attn.guard.calls != layers:
            raise ContextSplitError(
                f"context parallelism: {self.attn.guard.calls} of the model's {layers} "
                "attention layers ran through the split's backend"
            )


def local_row(cp: ContextParallel, mb: MicroBatch) -> LocalRow:
    """``mb``'s share for this cp rank."""
    s = mb.tokens.shape[1]
    split = cp.split(s)
    attn = cp.attention(split, mb.attention(), mb.doc_ids, mb.branch_ids)
    local = split.local_columns(mb.tokens.device)  # [S] local column or -1
    row, col = mb.comp_index // s, mb.comp_index % s
    lc = local[col]
    where = (lc >= 0).nonzero()[:, 0]
    index = row[where] * split.local_len + lc[where]
    return LocalRow(split.shard(mb.tokens), split.shard(mb.positions), attn, index, where)


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
    r = local_row(cp, mb)
    v = model(r.tokens, positions=r.positions, attn=r.attn).reshape(-1).index_select(0, r.index)
    r.check_calls(model)
    return cp.sum_values(v, r.where, mb.comp_index.numel())
