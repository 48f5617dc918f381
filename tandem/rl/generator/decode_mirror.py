"""Contiguous per-sequence K/V rows for the decode steps of the PyTorch attention path.

The paged pool (kv_cache.py) stays the generator's one record of every
token's keys and values: prefix sharing, copy-on-write and preemption all work
on its blocks. Read through the PyTorch path, though, the pool costs a page
gather per layer per step (every sequence's blocks copied into one padded
tensor) before attention can run. `DecodeMirror` takes that gather out of pure
decode steps, which are almost all of a rollout's steps: the i-th sequence of
the decode batch owns row i of a dense ``[layers, 2, rows, kv_heads, width,
head_dim]`` tensor, filled from the pool once and then extended by one token
per step (the pool still receives every token too). Attention is then two
batched matmuls and a softmax over contiguous rows.

A step whose batch differs from the last one (a sequence finished, joined or
came back) first moves the rows that are still current to their new places
and refills the others from the pool. A sequence that got tokens any other way
(a prefill, an extend, a recompute after preemption) is forgotten, so a row
only ever holds what the pool holds. While the batch stays the same (most steps), the
step's tensors (positions, slots, the mask's bias) are last step's, advanced in place,
not rebuilt from lists. The mirror grows with the batch and never
takes more bytes than the pool; a step that would need more runs on the page
gather instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tandem.rl.generator.kv_cache import KVCache
from tandem.rl.generator.scheduler import ScheduledChunk


@dataclass
class MirrorStep:
    """One decode step on the mirror: N sequences in rows 0..N-1."""

    tokens: torch.Tensor  # [N] long, the new token of each sequence
    positions: torch.Tensor  # [N] long, its position (context length - 1)
    slots: torch.Tensor  # [N] int64, its pool slot
    bias: torch.Tensor  # [N * Hkv, 1, width] 0 where a key is in context, -inf past it
    width: int  # keys attended: the longest context of the step


class DecodeMirror:
    def __init__(self, cache: KVCache, max_len: int) -> None:
        self.cache, self.max_len = cache, max_len
        layers, _, _, _, self.kv_heads, self.head_dim = cache.data.shape
        # [L, 2, R, Hkv, W, D]
        self.rows = cache.data.new_empty(layers, 2, 0, self.kv_heads, 0, self.head_dim)
        # rows x width may not exceed the pool
        self.budget_tokens = cache.num_blocks * cache.block_size
        self.seq_ids: list[int] = []  # the sequence of row i
        # positions of row i that hold the pool's values; -1: forgotten
        self.lengths: list[int] = []
        # steps served, rows moved / refilled, steps refused, steps that advanced the last one
        self.steps = self.moved = self.refilled = self.too_big = self.advanced = 0
        # the last step's tensors, advanced in place while the batch stays the same
        self._positions = self._slots = self._index = torch.empty(0, dtype=torch.long)
        self._bias: torch.Tensor | None = None  # [N, Hkv, cap]: 0 in context, -inf past it

    def forget(self, seq_ids: Iterable[int]) -> None:
        """These sequences got tokens another way: their rows no longer match the pool."""
        drop = set(seq_ids)
        self.lengths = [-1 if s in drop else n for s, n in zip(self.seq_ids, self.lengths)]

    def plan(self, chunks: list[ScheduledChunk], same_blocks: bool = True) -> MirrorStep | None:
        """Lay out the rows for a pure decode step (one sampled token per chunk), or None
        (every row forgotten) when the step's rows would outgrow the pool's size.

        When the step's sequences are the last step's, in the same rows, each one token
        further, the last step's tensors are advanced in place (positions and slots + 1, the
        new position unmasked) instead of rebuilt; ``same_blocks=False`` (the step copied
        blocks on write, which may move a sequence's last block) rebuilds them."""
        n, bs = len(chunks), self.cache.block_size
        ctx = [c.end for c in chunks]
        width = max(ctx)
        if not self.reserve(n, width):
            self.seq_ids, self.lengths = [], []
            self.too_big += 1
            return None
        where = {
            s: r for r, (s, length) in enumerate(zip(self.seq_ids, self.lengths)) if length >= 0
        }
        src, dst, refill = [], [], []
        for i, c in enumerate(chunks):
            r = where.get(c.seq.seq_id)
            if r is not None and self.lengths[r] == c.start:
                # holds every position before the new token
                if r != i:
                    src.append(r)
                    dst.append(i)
            else:
                refill.append(i)
        if src:  # the right side is a copy, so overlapping moves are safe
            w = max(self.lengths[r] for r in src)
            self.rows[:, :, dst, :, :w] = self.rows[:, :, src, :, :w]
        if refill:
            self._refill(refill, chunks)
        self.moved, self.refilled = self.moved + len(src), self.refilled + len(refill)
        advance = same_blocks and not (src or refill) and n == len(self.seq_ids) and self._valid()
        # once the step has written its tokens
        self.seq_ids, self.lengths = [c.seq.seq_id for c in chunks], ctx
        self.steps += 1
        dev = self.rows.device
        tokens = torch.tensor(
            [c.seq.token_ids[c.start] for c in chunks], dtype=torch.long, device=dev
        )
        if advance:  # the same sequences, one token further: advance last step's tensors
            self.advanced += 1
            positions, slots, bias = self._positions, self._slots, self._bias
            positions.add_(1)
            slots.add_(1)
            crossed = [i for i, c in enumerate(chunks) if c.start % bs == 0]  # a new block
            if crossed:
                first = [chunks[i].seq.block_table[chunks[i].start // bs] * bs for i in crossed]
                slots[crossed] = torch.tensor(first, dtype=torch.int64, device=dev)
            bias[self._index, :, positions] = 0.0  # the new token joins each row's context
        else:
            positions = torch.tensor([c.start for c in chunks], dtype=torch.long, device=dev)
            slots = torch.tensor(
                [c.seq.block_table[c.start // bs] * bs + c.start % bs for c in chunks],
                dtype=torch.int64,
                device=dev,
            )
            cap = self.rows.shape[4]
            bias = torch.zeros(n, cap, dtype=self.rows.dtype, device=dev)
            lens = torch.tensor(ctx, device=dev)
            bias.masked_fill_(torch.arange(cap, device=dev)[None, :] >= lens[:, None], -torch.inf)
            bias = bias[:, None, :].expand(n, self.kv_heads, cap).contiguous()  # [N, Hkv, cap]
            self._positions, self._slots, self._bias = positions, slots, bias
            self._index = torch.arange(n, device=dev)
        # [N * Hkv, 1, width], a view of the [N, Hkv, cap] buffer
        step_bias = bias[:, :, :width].reshape(n * self.kv_heads, 1, width)
        return MirrorStep(tokens, positions, slots, step_bias, width)

    def _valid(self) -> bool:
        """Whether last step's tensors still describe rows 0..N-1 (same buffer, same device)."""
        b = self._bias
        return b is not None and b.device == self.rows.device and b.shape[2] == self.rows.shape[4]

    def reserve(self, n: int, width: int) -> bool:
        """Room for n rows of ``width`` positions (grown geometrically, within the pool's size)."""
        rows, cap = self.rows.shape[2], self.rows.shape[4]
        if n <= rows and width <= cap:
            return True
        new_rows = max(n, rows)
        fits = self.budget_tokens // new_rows  # widest row the pool's size allows
        if width > fits:
            return False
        new_cap = min(max(width, cap), fits)
        if width > cap:  # double the width, as far as the pool's size and the model length allow
            new_cap = max(width, min(2 * cap, self.max_len, fits))
        grown = self.rows.new_zeros(
            *self.rows.shape[:2], new_rows, self.kv_heads, new_cap, self.head_dim
        )
        keep = min(cap, new_cap)
        grown[:, :, :rows, :, :keep] = self.rows[:, :, :, :, :keep]
        self.lengths = [length if length <= keep else -1 for length in self.lengths]
        self.rows = grown
        return True

    def _refill(self, rows: list[int], chunks: list[ScheduledChunk]) -> None:
        """Copy positions ``[0, start)`` of each listed row's sequence out of the pool."""
        bs = self.cache.block_size
        w = max(chunks[i].start for i in rows)
        if w == 0:
            return
        nb = -(-w // bs)
        tables = [chunks[i].seq.block_table[:nb] for i in rows]
        # [n, nb]
        ids = torch.tensor([t + [0] * (nb - len(t)) for t in tables], device=self.rows.device)
        pages = self.cache.data.index_select(2, ids.reshape(-1))  # [L, 2, n * nb, BS, Hkv, D]
        layers = pages.shape[0]
        pages = pages.view(layers, 2, len(rows), nb * bs, self.kv_heads, self.head_dim)[:, :, :, :w]
        self.rows[:, :, rows, :, :w] = pages.permute(0, 1, 2, 4, 3, 5)  # -> [L, 2, n, Hkv, w, D]

    def store(self, step: MirrorStep, new: torch.Tensor) -> None:
        """Write a step's new K/V ``[L, 2, N, Hkv, D]`` (every layer) into rows 0..N-1 at each
        row's position and into the pool at its slot: what `MirrorAttention` does per layer."""
        n = new.shape[2]
        index = torch.arange(n, device=new.device)
        # rows[:, :, i, :, p]: the two indexed dims go first, [N, L, 2, Hkv, D]
        self.rows[:, :, index, :, step.positions] = new.permute(2, 0, 1, 3, 4)
        pool = self.cache.data
        pool.view(*pool.shape[:2], -1, *pool.shape[4:]).index_copy_(2, step.slots, new)


class MirrorAttention:
    """The model's attention backend for a `MirrorStep`: store the new K/V in the pool and in
    rows 0..N-1 of the mirror, then attend over the rows."""

    def __init__(self, mirror: DecodeMirror, step: MirrorStep, scale: float) -> None:
        self.mirror, self.step, self.scale = mirror, step, scale
        self.index = torch.arange(step.tokens.shape[0], device=step.tokens.device)  # [N]

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [1, N, Hq, D], k/v [1, N, Hkv, D]
        s, pool, rows = self.step, self.mirror.cache.data, self.mirror.rows
        _, n, hq, d = q.shape
        hkv = k.shape[2]
        for i, new in enumerate((k[0], v[0])):
            pool[layer_id, i].view(-1, hkv, d).index_copy_(0, s.slots, new)
            # [N, Hkv, D] at row i, position ctx - 1
            rows[layer_id, i][self.index, :, s.positions] = new
        keys = rows[layer_id, 0, :n, :, : s.width].flatten(0, 1)  # [N * Hkv, W, D], a view
        values = rows[layer_id, 1, :n, :, : s.width].flatten(0, 1)
        scores = torch.baddbmm(
            s.bias, q[0].reshape(n * hkv, hq // hkv, d), keys.transpose(1, 2), alpha=self.scale
        )
        # [N * Hkv, G, D]; query head h reads KV head h // G
        out = torch.bmm(scores.softmax(dim=-1), values)
        return out.view(1, n, hq, d)
