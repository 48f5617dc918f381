"""CUDA graphs for decode steps: bucketed batch sizes over static buffers.

A decode step (one new token per sequence) launches the same kernels every
time; only the batch size and the values in the metadata change. So the
runner pads a decode batch up to the next bucket size, copies the step into
that bucket's static buffers, and replays a graph captured once per bucket.
Padded rows carry slot -1 (`store_kv` skips them) and context length 0 (the
decode kernel gives them zeros), so they touch no cache state; their logits
are dropped before sampling. Prefill/extend steps, batches larger than the
biggest bucket, and non-CUDA devices run eagerly.

`DecodeGraphs(capture=False)` runs exactly the padded static-buffer path
without capturing, which is how the padding logic is tested on CPU; on CUDA
the graphs are captured lazily, the first time a bucket is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem import device as seam
from tandem.rl.generator.kv_cache import KVCache, PagedAttention, PagedMeta

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _Bucket:
    """Static inputs and outputs of one batch size."""

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.ctx = torch.zeros(size, dtype=torch.int32, device=device)
        self.cu = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None  # the device's graph (tandem.device.capture)


class DecodeGraphs:
    """Padded, optionally graph-captured decode forwards: tokens -> logits [n, V]."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, PagedAttention], torch.Tensor],
        cache: KVCache,
        scale: float,
        max_model_len: int,
        *,
        impl: str | None = None,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: bool = True,
    ) -> None:
        self.forward, self.cache, self.scale, self.impl = forward, cache, scale, impl
        self.buckets = tuple(sorted(buckets))
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.capture = capture
        self.device = cache.data.device
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.replays = 0

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n rows, or None when n exceeds the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def run(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        ctx: list[int],
    ) -> torch.Tensor | None:
        """Logits [n, V] of one decode step, or None when the batch does not fit a bucket."""
        n = len(tokens)
        size = self.bucket_for(n)
        if size is None or any(len(t) > self.max_blocks for t in tables):
            return None
        b = self._buckets.get(size) or self._make(size)
        pad = size - n

        def fill(dst: torch.Tensor, values: list, fill_value: int) -> None:
            dst.copy_(torch.tensor(values + [fill_value] * pad, dtype=dst.dtype), non_blocking=True)

        fill(b.tokens, tokens, 0)
        fill(b.positions, positions, 0)
        fill(b.slots, slots, -1)
        fill(b.ctx, ctx, 0)
        rows = [t + [0] * (self.max_blocks - len(t)) for t in tables] + [
            [0] * self.max_blocks
        ] * pad
        b.tables.copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        if b.graph is not None:
            b.graph.replay()
            self.replays += 1
        else:
            b.logits = self._forward(b)
        return b.logits[:n]

    def _forward(self, b: _Bucket) -> torch.Tensor:
        meta = PagedMeta(
            slot_mapping=b.slots,
            block_tables=b.tables,
            cu_seqlens_q=b.cu,
            context_lens=b.ctx,
            max_q_len=1,
        )
        return self.forward(
            b.tokens, b.positions, PagedAttention(self.cache, meta, self.scale, impl=self.impl)
        )

    def _make(self, size: int) -> _Bucket:
        b = _Bucket(size, self.max_blocks, self.device)
        if self.capture:
            # Warm up on a side stream (Triton compiles, allocator settles), then capture.
            b.graph, b.logits, self._pool = seam.capture(
                self.device, lambda: self._forward(b), self._pool
            )
        self._buckets[size] = b
        return b

    def close(self) -> None:
        """Drop graphs and static buffers (their memory goes back with the KV pool)."""
        self._buckets.clear()
        self._pool = None
