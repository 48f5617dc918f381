"""The update's computation on packed micro-batches (tandem/rl/update/packing.py): token
log-probs, the policy loss with its global denominators (the optimizer step's, so the update is
the same however the batch is split), the sums reduced over the trainers' group and the
train/generation gap metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tandem.kernels.logprobs import token_logprobs_entropy
from tandem.parallel.loss import token_logprobs_at
from tandem.rl.algorithms import (
    KL_ESTIMATORS,
    OFFPOLICY_CORRECTIONS,
    CorrectionConfig,
    CorrectionInput,
    PolicyLossInput,
)
from tandem.rl.core.health import waiting
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.cp_batch import cp_token_logprobs
from tandem.rl.update.packing import MicroBatch


def token_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    *,
    with_entropy: bool,
    chunk_tokens: int = 1024,
    vocab_parallel: bool = False,
    cp: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(target) [K] and entropy [K] (fp32) of the micro-batch's K completion tokens.

    The vocab projection runs inside the model's forward through its ``head``
    hook, on the completion positions only, with `tandem.kernels.logprobs` (Triton on
    CUDA, token chunks elsewhere): no [L, V] logits tensor is ever built, and
    backward recomputes each chunk's logits. Values are in ``mb.comp_*`` order
    (see `scatter_completions`).

    ``vocab_parallel`` (a TP model, whose head is vocab-sharded): the model's
    own head runs, giving ``[B, S, V/tp]`` logits per rank, and
    `tandem.parallel.loss.token_logprobs_at` reads the completion positions without
    gathering the vocabulary.

    ``cp`` (a `tandem.parallel.cp.ContextParallel` of more than one rank): this rank runs
    its share of the row and the values are summed over cp (tandem/rl/update/cp_batch.py).
    """
    if cp is not None:
        return cp_token_logprobs(
            model, mb, cp, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )
    index, targets = mb.comp_index, mb.completion_targets()
    if vocab_parallel:
        logits = model(mb.tokens, attn=mb.attention(), **mb.model_inputs())
        return token_logprobs_at(logits, index, targets, with_entropy=with_entropy)

    def head(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        flat = h.reshape(-1, h.shape[-1]).index_select(0, index)  # [K, D]
        return token_logprobs_entropy(
            flat, weight, targets, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )

    return model(mb.tokens, attn=mb.attention(), head=head, **mb.model_inputs())


def scatter_completions(values: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """[K] completion values (from `token_logprobs`) -> [len(rows), width], zeros past each end."""
    out = values.new_zeros(len(mb.rows), width)
    out[mb.comp_row, mb.comp_col] = values[: mb.comp_row.numel()]
    return out


@torch.no_grad()
def recompute_logprobs(
    model: nn.Module,
    samples: list[RolloutSample],
    mbs: list[MicroBatch],
    width: int,
    device: torch.device,
    chunk_tokens: int = 1024,
    vocab_parallel: bool = False,
    after: Callable[[MicroBatch], None] | None = None,
    cp: Any = None,
) -> torch.Tensor:
    """Log-probs of every completion token under ``model`` [N, width] (old / reference);
    ``after(mb)`` runs after each micro-batch's forward; ``cp`` as in `token_logprobs`."""
    out = torch.zeros(len(samples), width, device=device)
    for mb in mbs:
        logp, _ = token_logprobs(
            model,
            mb,
            with_entropy=False,
            chunk_tokens=chunk_tokens,
            vocab_parallel=vocab_parallel,
            cp=cp,
        )
        if after is not None:
            after(mb)
        if mb.rows:
            out[mb.rows] = scatter_completions(logp, mb, width)
    return out


def completion_versions(
    samples: list[RolloutSample], width: int, device: torch.device
) -> torch.Tensor:
    """[N, width] long: the policy version that sampled each completion token (0 past the end)."""
    out = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        out[i, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
    return out.to(device)


def completion_tensors(
    samples: list[RolloutSample], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
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
    # [N, T] policy before this update (update layout). None when the batch is
    # used for exactly one optimizer step: the policy is then unchanged until
    # that step, so the training forward's own (detached) log-probs are the old
    # ones, recorded into ``seen_logp`` for the train/generation gap.
    old_logp: torch.Tensor | None
    advantages: torch.Tensor  # [N, T]
    gen_logp: torch.Tensor  # [N, T] generator log-probs (truncated IS)
    ref_logp: torch.Tensor | None  # [N, T] reference policy (KL)
    seen_logp: torch.Tensor | None = None  # [N, T] filled with the training forward's log-probs
    # when old_logp is None
    values: torch.Tensor | None = None  # [N, T] critic values before this update (PPO)
    returns: torch.Tensor | None = None  # [N, T] the critic's targets (GAE returns)
    versions: torch.Tensor | None = None  # [N, T] long: the version that sampled each token
    version: int = 0  # the policy version this update trains
    keep: torch.Tensor | None = None  # [N, T] bool: tokens a batch-wide correction keeps (m2po)


_SUMS = (
    "loss",
    "clipped",
    "entropy",
    "kl",
    "tokens",
    "steps",
    "value_sq_err",
    "value_tokens",
    "is_weight",
    "is_weight_sq",
    "dropped",
    "kl_behav",
    "kl_prox",
)
_LOSS_SUMS = (
    "loss",
    "clipped",
    "entropy",
    "kl",
    "tokens",
    "is_weight",
    "is_weight_sq",
    "dropped",
    "kl_behav",
    "kl_prox",
)


@dataclass
class UpdateSums:
    """The update phase's float64 sums, this rank's share until `all_reduce`.

    ``loss``: the policy loss over micro-batches (each its share of a step's global loss);
    ``clipped``, ``entropy``, ``kl`` (k3 to the reference), ``tokens``: token sums over the
    trained (masked-in) tokens; ``steps``: the policy's optimizer steps; ``value_sq_err``
    and ``value_tokens``: the critic's squared error against the returns and its tokens.
    The off-policy correction's, over the trained tokens: ``is_weight`` and ``is_weight_sq``
    (its weights and their squares: the effective sample size), ``dropped`` (weight 0),
    ``kl_behav`` (k3 of KL(behaviour || proximal)) and ``kl_prox`` (k3 of KL(proximal ||
    current)).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor
    tokens: torch.Tensor
    steps: torch.Tensor
    value_sq_err: torch.Tensor
    value_tokens: torch.Tensor
    is_weight: torch.Tensor
    is_weight_sq: torch.Tensor
    dropped: torch.Tensor
    kl_behav: torch.Tensor
    kl_prox: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> UpdateSums:
        return cls.of(torch.zeros(len(_SUMS), dtype=torch.float64, device=device))

    @classmethod
    def of(cls, flat: torch.Tensor) -> UpdateSums:
        """The fields of a float64 vector, in field order."""
        return cls(*flat.unbind(0))

    def flat(self) -> torch.Tensor:
        return torch.stack([getattr(self, k) for k in _SUMS])

    def add_loss(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """One micro-batch's policy loss and token sums (`completion_loss`'s), in place."""
        part = torch.stack([loss.detach(), *(stats[k] for k in _LOSS_SUMS[1:])])
        self._add(_LOSS_SUMS, part.double())

    def add_value(self, sq_err: torch.Tensor, tokens: torch.Tensor | float) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.float64, device=sq_err.device)
        self._add(("value_sq_err", "value_tokens"), torch.stack([sq_err.double(), tokens]))

    def __iadd__(self, other: UpdateSums) -> UpdateSums:
        self._add(_SUMS, other.flat())
        return self

    def _add(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        for k, v in zip(names, values.unbind(0)):
            setattr(self, k, getattr(self, k) + v)

    def all_reduce(self, counts: bool, group: dist.ProcessGroup | None) -> UpdateSums:
        """Collective over ``group``: the sums over its ranks; a rank with ``counts`` False (not
        the one rank per data-parallel replica that reports) adds zeros."""
        flat = self.flat() if counts else torch.zeros_like(self.flat())
        with waiting("all_reduce:update_sums"):
            dist.all_reduce(flat, group=group)
        return UpdateSums.of(flat)


@dataclass
class LossSpec:
    """Registered pieces (already looked up) and coefficients of the policy loss."""

    policy_loss: Callable
    policy_cfg: Any
    aggregation: Callable
    kl_estimator: Callable | None  # loss-term KL (None: off)
    kl_coef: float
    entropy_coef: float
    correction: Callable = OFFPOLICY_CORRECTIONS.get("none")  # tandem/rl/algorithms/offpolicy.py
    correction_cfg: CorrectionConfig = field(default_factory=CorrectionConfig)
    chunk_tokens: int = 1024  # tokens per chunk of the memory-lean log-prob path
    vocab_parallel: bool = False  # TP: log-probs from the vocab-sharded head (token_logprobs)
    cp: Any = None  # a tandem.parallel.cp.ContextParallel: rows split over cp (token_logprobs)


def micro_batch_loss(
    model: nn.Module, mb: MicroBatch, inp: LossInputs, spec: LossSpec, norm: Any, width: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated loss of one micro-batch (its share of the step's global loss) and token sums."""
    logp_l, ent_l = token_logprobs(
        model,
        mb,
        with_entropy=True,
        chunk_tokens=spec.chunk_tokens,
        vocab_parallel=spec.vocab_parallel,
        cp=spec.cp,
    )
    return completion_loss(logp_l, ent_l, mb, inp, spec, norm, width)


def completion_loss(
    logp_l: torch.Tensor,
    ent_l: torch.Tensor,
    mb: MicroBatch,
    inp: LossInputs,
    spec: LossSpec,
    norm: Any,
    width: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a micro-batch from its ``[K]`` completion log-probs / entropies
    (``mb.comp_*`` order)."""
    if not mb.rows:  # padding micro-batch: keeps collectives in step, no gradient signal
        return logp_l.sum() * 0.0, {}
    rows = mb.rows
    # [n, T]
    logp, ent = scatter_completions(logp_l, mb, width), scatter_completions(ent_l, mb, width)
    m = inp.mask[rows]
    if inp.old_logp is None:
        old = logp.detach()
        if inp.seen_logp is not None:
            inp.seen_logp[rows] = old
    else:
        old = inp.old_logp[rows]
    behav = inp.gen_logp[rows]
    corr = spec.correction(
        CorrectionInput(
            logp=logp.detach(),
            prox_logp=old,
            behav_logp=behav,
            mask=m,
            version=inp.version,
            versions=inp.versions[rows] if inp.versions is not None else None,
            keep=inp.keep[rows] if inp.keep is not None else None,
        ),
        spec.correction_cfg,
    )
    pl_inp = PolicyLossInput(
        logp=logp, old_logp=corr.old_logp, advantages=inp.advantages[rows], mask=m
    )
    out = spec.policy_loss(pl_inp, spec.policy_cfg)
    tok_loss = out.loss * corr.weight
    kl = None
    if inp.ref_logp is not None:
        kl = KL_ESTIMATORS.get("k3")(logp.detach(), inp.ref_logp[rows])  # reported KL
        if spec.kl_estimator is not None:
            tok_loss = tok_loss + spec.kl_coef * spec.kl_estimator(logp, inp.ref_logp[rows])
    if spec.entropy_coef:
        tok_loss = tok_loss - spec.entropy_coef * ent
    loss = spec.aggregation(tok_loss, m, norm)
    with torch.no_grad():
        w = corr.weight * m
        lr = torch.where(m.bool(), corr.old_logp - behav, 0.0).clamp(-20.0, 20.0)  # log prox/behav
        sums = {
            "clipped": (out.metrics["clipped"].float() * m).sum(),
            "entropy": (ent * m).sum(),
            "kl": (kl * m).sum() if kl is not None else m.new_zeros(()),
            "tokens": m.sum(),
            "is_weight": w.sum(),
            "is_weight_sq": (w * w).sum(),
            "dropped": ((corr.weight == 0) * m).sum(),
            "kl_behav": ((torch.expm1(lr) - lr) * m).sum(),
            "kl_prox": (out.metrics["approx_kl"] * m).sum(),
        }
    return loss, sums


def gap_metrics(
    update_logp: torch.Tensor,
    gen_logp: torch.Tensor,
    mask: torch.Tensor,
    weight: float = 1.0,
    *,
    group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """How far the rollout's sampled-token log-probs are from the update's recomputation
    with the same weights, over the ranks of ``group``; ``weight``: 1 on the one rank per
    data-parallel replica that counts (the policy's ``counts_stats``), else 0."""
    gap = (update_logp - gen_logp).abs() * mask * weight
    # k3 of KL(generator || update) on the generator's samples: r - 1 - log r, r = p_upd / p_gen
    k3 = KL_ESTIMATORS.get("k3")(gen_logp, update_logp) * mask * weight
    stats = torch.stack(
        [
            gap.sum(),
            mask.sum(),
            (gap > 0).sum(),
            k3.sum(),
            gap.max() if gap.numel() else gap.new_zeros(()),
        ]
    ).double()
    gmax = stats[4:].clone()
    dist.all_reduce(stats[:4], group=group)
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    tokens = max(stats[1].item(), 1.0)
    return {
        "gap/abs_mean": stats[0].item() / tokens,
        "gap/abs_max": gmax.item(),
        "gap/tokens_differ": stats[2].item(),
        "gap/k3": stats[3].item() / tokens,
    }
