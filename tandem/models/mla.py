"""Multi-head latent attention (DeepSeek-V2/V3), around the same attention-backend seam.

Queries come from a low-rank projection (``wq_a`` -> RMSNorm -> ``wq_b``; or one ``wq``),
keys and values from a shared latent: ``wkv_a`` maps x to ``kv_lora_rank`` latent features
plus one rotary key of ``qk_rope_head_dim`` shared by all heads (the decoupled RoPE key);
the latent, normalised, is expanded by ``wkv_b`` into each head's non-rotary key part and
its value. A head's query and key are ``[nope | rope]`` (``head_dim`` wide).

This module hands the backend *decompressed* per-head keys and values, so every backend
(training, the generator's paged pool, FP8 rounding, rl.exact's batch-invariant one) runs
MLA unchanged: the values are zero-padded from ``v_head_dim`` to ``head_dim`` (the extra
output columns are zeros and dropped), and YaRN's ``mscale_all_dim`` correction of the softmax
scale is folded into the queries. The paged pool therefore holds ``2 * heads * head_dim``
entries a token instead of MLA's ``kv_lora_rank + qk_rope_head_dim``: the latent paged cache
with absorbed projections is follow-up work (docs/models.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.args import ModelArgs
from tandem.models.attention import AttentionBackend, attend
from tandem.models.deepseek import MLA_NORM_EPS
from tandem.models.rope import apply_rotary


def softmax_scale_factor(args: ModelArgs) -> float:
    """What MLA multiplies ``1 / sqrt(head_dim)`` by: ``mscale(factor, mscale_all_dim)^2``
    under YaRN with ``mscale_all_dim`` (DeepSeek's reference code), 1 otherwise."""
    s = args.rope_scaling or {}
    m, factor = s.get("mscale_all_dim") or 0, s.get("factor") or 1.0
    if s.get("rope_type", "default") == "default" or not m or factor <= 1:
        return 1.0
    mscale = 0.1 * m * math.log(factor) + 1.0
    return mscale * mscale


class MLAttention(nn.Module):
    """See the module docstring; the state-dict names follow tandem/models/hf.py's table."""

    def __init__(self, args: ModelArgs, layer_id: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.rope_dim, self.v_dim = args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank, self.interleave = args.kv_lora_rank, args.rope_interleave
        d, h, qk = args.hidden_size, args.num_heads, args.head_dim
        self.wq: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_a_norm = norm(args.q_lora_rank, MLA_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(d, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_norm = norm(self.kv_rank, MLA_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, h * (qk - self.rope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.q_scale = softmax_scale_factor(args)
        self.wqkv = None  # no fused inference layout (`fuse` keeps the projections)

    def fuse(self) -> None:
        """`Transformer.fuse_projections`' hook: MLA keeps its projections as they are."""

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:  # pairs (0, 1), (2, 3), ... -> halves, as transformers computes
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, D]
        h, qk, rope = self.num_heads, self.head_dim, self.rope_dim
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rot = q.view(b, s, h, qk).split([qk - rope, rope], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, rope], dim=-1)  # [B, S, R], [B, S, r]
        kv = self.wkv_b(self.kv_a_norm(latent)).view(b, s, h, qk - rope + self.v_dim)
        k_nope, v = kv.split([qk - rope, self.v_dim], dim=-1)
        k_rot = self._rope(k_rot.view(b, s, 1, rope), cos, sin).expand(b, s, h, rope)
        q = torch.cat([q_nope, self._rope(q_rot, cos, sin)], dim=-1)  # [B, S, H, qk]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rot], dim=-1)  # [B, S, H, qk]
        out = attend(attn, self.layer_id, q, k, F.pad(v, (0, qk - self.v_dim)))  # [B, S, H, qk]
        return self.wo(out[..., : self.v_dim].reshape(b, s, h * self.v_dim))  # [B, S, D]
