"""Rollouts packed into micro-batches for the update (tandem/rl/update/loss.py computes on them).

Every micro-batch holds whole sequences (prompt + completion), about ``micro_batch_tokens``
tokens of them, laid end to end with per-document positions and attended sequence by sequence
(or, where every sequence gets a row of its own, as padded rows under plain causal attention):
little compute goes to padding, and none to attention between sequences. Each rank runs the
same number of micro-batches (empty ones are padded in: `sync_micro_batch_count`), because
FSDP2's collectives must match across ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.kernels import batch_invariant
from tandem.models.attention import (
    AttentionBackend,
    CausalAttention,
    DocumentAttention,
    ExactAttention,
    SegmentAttention,
)
from tandem.rl.rollout.types import RolloutSample


@dataclass
class MicroBatch:
    """Whole sequences laid out as ``B`` rows of ``S`` tokens (see `_build`)."""

    rows: list[int]  # sample indices (into the rank's sample list) in this micro-batch
    tokens: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S] per-document positions
    doc_ids: torch.Tensor  # [B, S] document per token, -1 on padding
    targets: torch.Tensor  # [B, S] next-token ids (0 where unused; see comp_targets)
    # per sample: (first logit position of its completion in the flat [B*S], length)
    offsets: list[tuple[int, int]]
    # The completion tokens only, K of them in sample order: where they sit in
    # the flat [B*S] layout and where they go in the [len(rows), width] layout.
    comp_index: torch.Tensor | None = None  # [K] flat positions
    comp_row: torch.Tensor | None = None  # [K] local sample
    comp_col: torch.Tensor | None = None  # [K] column
    # Shared prompts (pack_micro_batches(share_prompts=True)): samples of one prompt
    # are one document, the prompt once (branch 0) and each completion a branch; the
    # last prompt position then predicts every branch's first token, so targets are
    # per completion token (comp_targets [K]) rather than per position.
    branch_ids: torch.Tensor | None = None  # [B, S]
    comp_targets: torch.Tensor | None = None  # [K]
    # Attention by segments (tandem.models.attention.SegmentAttention): one per sample,
    # its prompt then its completion; None where every row is one sample from
    # column 0 (plain causal attention is then exact) or when not built.
    seg_gather: torch.Tensor | None = None  # [V, W] flat positions
    seg_scatter: torch.Tensor | None = None  # [B*S] flat segment positions
    one_per_row: bool = False
    # A vision-language policy (tandem/rl/update/vision.py): positions become M-RoPE [3, B, S]
    # and the image tokens take these rows.
    images: Any = None  # tandem.models.vlm.ImageInputs
    # wraps the attention backend (FP8 KV: tandem.kernels.kv_quant.KVQuantAttention rounds K and
    # V as the rollout's pool did); set per forward by the policy that runs it
    kv_wrap: Callable[[AttentionBackend], AttentionBackend] | None = None

    def model_inputs(self) -> dict[str, Any]:
        """The model's keyword inputs besides the tokens and attention."""
        kw: dict[str, Any] = {"positions": self.positions}
        if self.images is not None:
            kw["images"] = self.images
        return kw

    def attention(self, wrapped: bool = True) -> AttentionBackend:
        """The backend this layout needs; ``wrapped``: with ``kv_wrap`` (the policy's forwards;
        another model reading the same micro-batch, the critic, passes False)."""
        backend = self._attention()
        return backend if self.kv_wrap is None or not wrapped else self.kv_wrap(backend)

    def _attention(self) -> AttentionBackend:
        if batch_invariant.enabled():
            # rl.exact: the generator's attention function, whatever the packing
            return ExactAttention(self.doc_ids, self.branch_ids)
        if self.one_per_row:
            return CausalAttention()
        if self.seg_gather is not None:
            return SegmentAttention(self.seg_gather, self.seg_scatter)
        return DocumentAttention(self.doc_ids, self.branch_ids)

    def completion_targets(self) -> torch.Tensor:
        """[K] next-token ids of the completion tokens, in ``comp_index`` order."""
        if self.comp_targets is not None:
            return self.comp_targets
        return self.targets.reshape(-1)[self.comp_index]


def _units(
    samples: list[RolloutSample], indices: list[int], share: bool, budget: int
) -> list[list[int]]:
    """Samples grouped into packing units: one sample each, or (``share``) the samples
    of one prompt (equal ``prompt_ids`` and the same images), split where a unit would pass
    ``budget``."""
    if not share:
        return [[i] for i in indices]
    by_prompt: dict[tuple[tuple[int, ...], int], list[list[int]]] = {}
    for i in indices:
        s = samples[i]
        # equal ids, other pictures: apart
        units = by_prompt.setdefault((tuple(s.prompt_ids), id(s.images)), [[]])
        if units[-1] and _unit_len(samples, units[-1] + [i]) > budget:
            units.append([])
        units[-1].append(i)
    return [u for units in by_prompt.values() for u in units]


def _unit_len(samples: list[RolloutSample], unit: list[int]) -> int:
    """Input tokens of a unit: the prompt once, then each completion but its last token."""
    return len(samples[unit[0]].prompt_ids) + sum(
        max(len(samples[i].completion_ids) - 1, 0) for i in unit
    )


def pack_micro_batches(
    samples: list[RolloutSample],
    indices: list[int],
    budget: int,
    device: torch.device,
    multiple: int = 1,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Greedy grouping in order by a token budget; a sequence longer than the budget gets a
    micro-batch of its own.

    ``multiple``: row length rounded up to it (sequence-parallel TP splits rows into ``tp`` pieces).
    ``share_prompts``: the samples of one prompt share one copy of it (see `MicroBatch`):
    fewer tokens when prompts are long and groups large, the same log-probs and
    gradients."""
    groups: list[list[list[int]]] = []
    cur: list[list[int]] = []
    used = 0
    for unit in _units(samples, indices, share_prompts, budget):
        n = _unit_len(samples, unit)
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(unit)
        used += n
    if cur:
        groups.append(cur)
    return [_build(samples, g, device, multiple, share_prompts) for g in groups]


def _build(
    samples: list[RolloutSample],
    units: list[list[int]],
    device: torch.device,
    multiple: int = 1,
    shared: bool = False,
) -> MicroBatch:
    """Lay the units out as ``[B, S]`` tokens, with the attention that layout needs.

    Unshared units no two of which fit in a row as long as the longest one (each
    longer than half of it) become right-padded rows of one sample each, for plain
    causal attention. Anything else is attended segment by segment
    (`SegmentAttention`), whose cost does not depend on the row layout, so the units
    go end to end in one row (S = their total, rounded up to ``multiple``): no
    padding tokens through the projections and MLPs.
    """
    lengths = [_unit_len(samples, u) for u in units]
    width = -(-max(lengths, default=1) // multiple) * multiple
    one_per_row = not shared and (len(lengths) < 2 or sum(sorted(lengths)[:2]) > width)
    if one_per_row:
        place = [(r, 0) for r in range(len(units))]  # per unit: (packed row, start)
    else:
        width = -(-sum(lengths) // multiple) * multiple
        place = [(0, at) for at in itertools.accumulate(lengths, initial=0)][: len(units)]
    b = max(len(units), 1) if one_per_row else 1
    toks = [[0] * width for _ in range(b)]
    tgts = [[0] * width for _ in range(b)]
    pos = [[0] * width for _ in range(b)]
    docs = [[-1] * width for _ in range(b)]
    branch = [[0] * width for _ in range(b)]
    rows, offsets, index, comp_targets = [], [], [], []
    # Segments (SegmentAttention): per sample, the flat positions of its prompt, then
    # of its completion, w long at most; scatter: per packed position, the flat
    # segment position whose output it takes (a prompt's from its first segment).
    segments: list[list[int]] = []
    w = max(
        len(samples[u[0]].prompt_ids) + max(max(len(samples[i].completion_ids) - 1, 0) for i in u)
        for u in units
    )
    scatter = [0] * (b * width)  # padding takes any output: nothing reads it
    for d, (unit, (r, at)) in enumerate(zip(units, place)):
        prompt = samples[unit[0]].prompt_ids
        p = len(prompt)
        flat_prompt = list(range(r * width + at, r * width + at + p))
        scatter[flat_prompt[0] : flat_prompt[-1] + 1] = range(
            len(segments) * w, len(segments) * w + p
        )
        toks[r][at : at + p] = prompt
        tgts[r][at : at + p - 1] = prompt[1:]
        pos[r][at : at + p] = range(p)
        docs[r][at : at + p] = [d] * p
        last_col = at + p - 1  # the last prompt token predicts each completion's first token
        last_prompt = r * width + last_col
        at += p
        for k, i in enumerate(unit):
            comp = samples[i].completion_ids
            rows.append(i)
            offsets.append((last_prompt, len(comp)))
            if not comp:  # nothing sampled (e.g. an over-long agentic prompt): no targets
                segments.append(flat_prompt)
                continue
            c = len(comp) - 1  # input tokens of this branch
            scatter[r * width + at : r * width + at + c] = range(
                len(segments) * w + p, len(segments) * w + p + c
            )
            segments.append(flat_prompt + list(range(r * width + at, r * width + at + c)))
            tgts[r][last_col] = comp[0]  # exact when unshared; comp_targets otherwise
            toks[r][at : at + c] = comp[:-1]
            tgts[r][at : at + c] = comp[1:]
            pos[r][at : at + c] = range(p, p + c)
            docs[r][at : at + c] = [d] * c
            branch[r][at : at + c] = [k + 1] * c
            index += [last_prompt] + list(range(r * width + at, r * width + at + c))
            comp_targets += comp
            at += c

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    row = [k for k, (_, n) in enumerate(offsets) for _ in range(n)]
    col = [j for _, n in offsets for j in range(n)]
    mb = MicroBatch(
        rows,
        t(toks),
        t(pos),
        t(docs),
        t(tgts),
        offsets,
        t(index),
        t(row),
        t(col),
        branch_ids=t(branch) if shared else None,
        comp_targets=t(comp_targets) if shared else None,
    )
    if one_per_row:
        mb.one_per_row = True  # right-padded rows of one sample each: plain causal attention
    elif segments:
        # padded last: never attended
        mb.seg_gather = t([seg + [seg[-1]] * (w - len(seg)) for seg in segments])
        mb.seg_scatter = t(scatter)
    return mb


def empty_micro_batch(device: torch.device, width: int = 1) -> MicroBatch:
    """A stand-in of one short row so every rank runs the same number of forwards."""
    z = torch.zeros(1, width, dtype=torch.long, device=device)
    return MicroBatch([], z, z, z, z, [], z[0], z[0][:0], z[0][:0])


def sync_micro_batch_count(
    mbs: list[MicroBatch],
    device: torch.device,
    width: int = 1,
    *,
    group: dist.ProcessGroup | None,
) -> list[MicroBatch]:
    """``mbs`` padded with empty micro-batches to the most any rank of ``group`` has."""
    n = torch.tensor([len(mbs)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return mbs + [empty_micro_batch(device, width) for _ in range(int(n.item()) - len(mbs))]
