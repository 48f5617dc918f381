"""The paged KV pool and the attention backend that reads and writes it.

One preallocated tensor holds every layer's keys and values as fixed-size
blocks: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``. It is
carved out at the start of a rollout (from a byte budget or a block count)
and freed at its end by dropping the object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.dispatch import use_triton
from tandem.kernels.paged_attention import (
    TorchPlan,
    paged_attention,
    plan_torch,
    store_kv,
    store_kv_slots,
    valid_slots,
)
from tandem.models.args import ModelArgs


class KVCache:
    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV pool needs at least one block (got {num_blocks})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.zeros(args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim,
                                dtype=dtype, device=device)  # [L, 2, NB, BS, Hkv, D]

    @staticmethod
    def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem

    @classmethod
    def from_budget(cls, args: ModelArgs, budget_bytes: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, max_blocks: int | None = None) -> KVCache:
        """As many blocks as ``budget_bytes`` holds, and at most ``max_blocks``."""
        n = budget_bytes // cls.bytes_per_block(args, block_size, dtype)
        return cls(args, n if max_blocks is None else min(n, max_blocks), block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block src into dst in every layer."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]


@dataclass
class PagedMeta:
    """Attention metadata of one generator step (explicit, never a global)."""

    slot_mapping: torch.Tensor  # [T] int32: cache slot of every new token
    block_tables: torch.Tensor  # [N, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [N+1] int32
    context_lens: torch.Tensor  # [N] int32, includes the new tokens
    max_q_len: int


class PagedAttention:
    """Attention backend for the model's seam: store new K/V, attend over the pages."""

    def __init__(self, cache: KVCache, meta: PagedMeta, scale: float, impl: str | None = None) -> None:
        self.cache, self.meta, self.scale, self.impl = cache, meta, scale, impl
        self._plan: TorchPlan | None = None  # the PyTorch path's step metadata, built at layer 0
        self._slots: tuple[torch.Tensor, torch.Tensor | None] | None = None  # likewise, for the K/V stores

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [1, T, Hq, D], k/v [1, T, Hkv, D]: the step's tokens of all sequences, flattened.
        kc, vc = self.cache.data[layer_id, 0], self.cache.data[layer_id, 1]
        m = self.meta
        if use_triton(q, self.impl):
            store_kv(k[0], v[0], kc, vc, m.slot_mapping, impl=self.impl)
        else:
            if self._slots is None:
                self._slots = valid_slots(m.slot_mapping)
            store_kv_slots(k[0], v[0], kc, vc, *self._slots)
            if self._plan is None and m.context_lens.numel():
                self._plan = plan_torch(m.block_tables, m.cu_seqlens_q, m.context_lens, kc.shape[1],
                                        q.shape[1], m.max_q_len)
        out = paged_attention(q[0], kc, vc, m.block_tables, m.cu_seqlens_q, m.context_lens, self.scale,
                              impl=self.impl, max_q_len=m.max_q_len, plan=self._plan)
        return out.unsqueeze(0)  # [1, T, Hq, D]
