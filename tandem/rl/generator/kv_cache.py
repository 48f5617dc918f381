"""The paged KV pool and the attention backend that reads and writes it.

One preallocated tensor holds every layer's keys and values as fixed-size
blocks: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``. It is
carved out at the start of a rollout (from a byte budget or a block count)
and freed at its end by dropping the object.

With an FP8 `KVQuant` the blocks are ``float8_e4m3fn`` / ``float8_e5m2`` (one byte an entry,
so a byte budget holds twice the tokens of bf16 and four times fp32's) and every entry reads
back as ``fp8 * scale`` (`tandem.kernels.kv_quant`): one scale per (layer, K or V, KV head),
given by the caller, or one per slot written with the entry (``per_token``, 4 bytes per
slot and KV head beside the ``head_dim`` bytes of the entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem import device as seam
from tandem.kernels import batch_invariant
from tandem.kernels import kv_quant as kvq
from tandem.kernels.dispatch import use_triton
from tandem.kernels.paged_attention import paged_attention, store_kv
from tandem.kernels.paged_attention_torch import TorchPlan, plan_torch, store_kv_slots, valid_slots
from tandem.kernels.sink_attention import paged_sink_attention, paged_sink_attention_exact
from tandem.models.args import ModelArgs
from tandem.models.linear_attention import Segments
from tandem.rl.core.configlib import ConfigError


@dataclass(frozen=True)
class KVQuant:
    """An FP8 pool: the storage dtype, and either calibrated scales or per-token ones."""

    dtype: torch.dtype  # torch.float8_e4m3fn | torch.float8_e5m2
    per_token: bool = False  # scales written per slot with each entry
    scales: torch.Tensor | None = None  # calibrated: [L, 2, Hkv] fp32 powers of two; None: to size


def make_quant(kv_dtype: str, kv_scales: str, scales: torch.Tensor | None) -> KVQuant | None:
    """The pool's `KVQuant` for the ``kv_dtype`` / ``kv_scales`` settings (None: no FP8).
    Calibrated scales must be given: a pool never runs on placeholder scales."""
    if kv_dtype == "auto":
        return None
    dtype = kvq.storage_dtype(kv_dtype)
    if kv_scales == "per_token":
        return KVQuant(dtype, per_token=True)
    if kv_scales != "calibrated":
        raise ValueError(f"kv_scales: expected 'calibrated' or 'per_token', got {kv_scales!r}")
    if scales is None:
        raise ValueError(
            f"kv_dtype {kv_dtype!r} with calibrated scales: no scales were given "
            "(the pool refuses to run on default scales)"
        )
    return KVQuant(dtype, scales=scales)


class KVCache:
    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        quant: KVQuant | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV pool needs at least one block (got {num_blocks})")
        self.num_blocks, self.block_size, self.quant = num_blocks, block_size, quant
        self.budget_blocks = num_blocks  # what the byte budget held before any cap (`from_budget`)
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        store = quant.dtype if quant else dtype
        if quant is not None and not seam.supports_dtype(device, store):
            raise ConfigError(
                f"rollout.kv_dtype: device {device.type} cannot hold {store} tensors "
                "(torch.accelerator.get_device_capability); set rollout.kv_dtype = 'auto'"
            )
        self.data = torch.zeros(shape, dtype=store, device=device)  # [L, 2, NB, BS, Hkv, D]
        self.scales: torch.Tensor | None = None  # [L, 2, Hkv] or, per token, [L, 2, NB, BS, Hkv]
        # calibrated scales: entries clamped to +-max, and token rows stored (summed over layers)
        self.saturated = torch.zeros((), dtype=torch.int64, device=device)
        self.stored = torch.zeros((), dtype=torch.int64, device=device)
        if quant is not None:
            if quant.per_token:
                self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            else:
                want = (args.num_layers, 2, args.num_kv_heads)
                if quant.scales is None or tuple(quant.scales.shape) != want:
                    got = None if quant.scales is None else list(quant.scales.shape)
                    raise ValueError(
                        f"KV scales must be {list(want)} (layers, K/V, KV heads); got {got}"
                    )
                self.scales = quant.scales.to(device=device, dtype=torch.float32).contiguous()

    @staticmethod
    def bytes_per_block(
        args: ModelArgs, block_size: int, dtype: torch.dtype, quant: KVQuant | None = None
    ) -> int:
        """Bytes of one block in every layer: entries in ``dtype`` (the quant's, when given),
        plus the per-token scales."""
        elem = torch.empty((), dtype=quant.dtype if quant else dtype).element_size()
        scale = 4 if quant is not None and quant.per_token else 0
        per_slot = args.num_kv_heads * (args.head_dim * elem + scale)
        return args.num_layers * 2 * block_size * per_slot

    @classmethod
    def from_budget(
        cls,
        args: ModelArgs,
        budget_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_blocks: int | None = None,
        quant: KVQuant | None = None,
    ) -> KVCache:
        """As many blocks as ``budget_bytes`` holds, and at most ``max_blocks``."""
        n = budget_bytes // cls.bytes_per_block(args, block_size, dtype, quant)
        blocks = n if max_blocks is None else min(n, max_blocks)
        cache = cls(args, blocks, block_size, dtype, device, quant)
        cache.budget_blocks = n
        return cache

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 4 if self.quant is not None and self.quant.per_token else 0
        return self.data.numel() * self.data.element_size() + extra

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K scales, V scales) of one layer for the kernels (None, None without FP8)."""
        if self.scales is None:
            return None, None
        return self.scales[layer_id, 0], self.scales[layer_id, 1]

    def count_saturated(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Calibrated scales: add the entries of the stored tokens (``slots >= 0``) that
        saturate to the count (no host sync)."""
        if self.quant is None or self.quant.per_token:
            return
        ks, vs = self.layer_scales(layer_id)
        keep = (slots >= 0)[:, None, None]  # [T, 1, 1]
        self.stored += keep.sum()
        over = (kvq.saturated(k, ks[:, None], self.data.dtype) & keep).sum()
        self.saturated += over + (kvq.saturated(v, vs[:, None], self.data.dtype) & keep).sum()

    def saturated_share(self) -> float:
        """Share of the K and V entries stored so far that saturated (one host sync)."""
        entries = self.stored.item() * 2 * self.data.shape[-2] * self.data.shape[-1]
        return self.saturated.item() / entries if entries else 0.0

    def rescale(self, scales: torch.Tensor) -> int:
        """Calibrated scales: take ``scales [L, 2, Hkv]`` for the entries written from now on and
        re-quantise the stored entries of every head whose scale changed from the old scale to
        the new one, in place (one rounding more: a smaller scale may saturate an entry, a larger
        one drops its low bits; both powers of two, so an entry that fits either way is exact).
        The scales tensor keeps its address (captured graphs read it). Returns the heads
        re-quantised."""
        assert self.quant is not None and not self.quant.per_token and self.scales is not None
        new = scales.to(device=self.scales.device, dtype=torch.float32)
        if tuple(new.shape) != tuple(self.scales.shape):
            raise ValueError(f"KV scales must be {list(self.scales.shape)}, got {list(new.shape)}")
        changed = new != self.scales  # [L, 2, Hkv]
        heads = int(changed.sum())
        if heads and self.data.numel():
            for layer, kv in changed.any(dim=2).nonzero().tolist():
                part = self.data[layer, kv]  # [NB, BS, Hkv, D]
                old, to = self.scales[layer, kv][:, None], new[layer, kv][:, None]
                requant = kvq.quantize(kvq.dequantize(part, old), to, self.data.dtype)
                part.copy_(torch.where(changed[layer, kv][:, None], requant, part))
        self.scales.copy_(new)
        return heads

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block src into dst in every layer (and its per-token scales)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
        if self.quant is not None and self.quant.per_token:
            self.scales[:, :, dst] = self.scales[:, :, src]


@dataclass
class PagedMeta:
    """Attention metadata of one generator step (explicit, never a global)."""

    slot_mapping: torch.Tensor  # [T] int32: cache slot of every new token
    block_tables: torch.Tensor  # [N, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [N+1] int32
    context_lens: torch.Tensor  # [N] int32, includes the new tokens
    max_q_len: int


class PagedAttention:
    """Attention backend for the model's seam: store new K/V, attend over the pages.

    A GPT-OSS layer (``sinks`` / ``window`` given) attends through the PyTorch reference
    `paged_sink_attention` on every device (no Triton kernel for sinks yet). A linear-attention
    layer (Qwen3.5) reads the step's chunks as ``segments`` and their recurrent state as
    ``linear_state`` (tandem/rl/generator/recurrent_state.py), both set by the runner."""

    sinks_and_windows = True
    segments: Segments | None = None
    linear_state: object = None

    def linear_segments(self, b: int, s: int, device: torch.device) -> Segments:
        if self.segments is None:
            raise ValueError("this generator has no recurrent-state cache for linear attention")
        return self.segments

    def __init__(
        self, cache: KVCache, meta: PagedMeta, scale: float, impl: str | None = None
    ) -> None:
        self.cache, self.meta, self.scale, self.impl = cache, meta, scale, impl
        self._plan: TorchPlan | None = None  # the PyTorch path's step metadata, built at layer 0
        # likewise, for the K/V stores
        self._slots: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        # q [1, T, Hq, D], k/v [1, T, Hkv, D]: the step's tokens of all sequences, flattened.
        kc, vc = self.cache.data[layer_id, 0], self.cache.data[layer_id, 1]
        ks, vs = self.cache.layer_scales(layer_id)
        m = self.meta
        self.cache.count_saturated(layer_id, k[0], v[0], m.slot_mapping)
        if use_triton(q, self.impl):
            store_kv(k[0], v[0], kc, vc, m.slot_mapping, impl=self.impl, k_scale=ks, v_scale=vs)
        else:
            if self._slots is None:
                self._slots = valid_slots(m.slot_mapping)
            store_kv_slots(k[0], v[0], kc, vc, *self._slots, k_scale=ks, v_scale=vs)
            if self._plan is None and m.context_lens.numel():
                self._plan = plan_torch(
                    m.block_tables,
                    m.cu_seqlens_q,
                    m.context_lens,
                    kc.shape[1],
                    q.shape[1],
                    m.max_q_len,
                )
        if sinks is not None or window is not None:
            exact = batch_invariant.enabled()
            out = (paged_sink_attention_exact if exact else paged_sink_attention)(
                q[0], kc, vc, m.block_tables, m.cu_seqlens_q, m.context_lens, self.scale,
                sinks, window,
            )  # fmt: skip
            return out.unsqueeze(0)
        out = paged_attention(
            q[0],
            kc,
            vc,
            m.block_tables,
            m.cu_seqlens_q,
            m.context_lens,
            self.scale,
            impl=self.impl,
            max_q_len=m.max_q_len,
            plan=self._plan,
            k_scale=ks,
            v_scale=vs,
        )
        return out.unsqueeze(0)  # [1, T, Hq, D]
