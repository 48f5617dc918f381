"""Decoder-only transformer (Llama-3 / Qwen2 / Qwen3, their MoE kin, GPT-OSS, DeepSeek-V3,
Qwen3.5's hybrid of gated DeltaNet and gated attention layers).

The module tree mirrors torchtitan's Llama so parallel/ can address it by name:
``tok_embeddings``, ``layers`` (an ``nn.ModuleDict`` keyed "0".."L-1" so a
pipeline stage can delete the layers it does not own), ``norm`` and ``output``;
any of the three non-layer modules may be set to None by a pipeline split.
A block has either ``feed_forward`` (dense SwiGLU) or ``moe`` (tandem/models/moe.py),
never both, as in torchtitan's MoE models.
Numerics follow transformers (fp32 RMSNorm statistics, fp32 RoPE tables), so
logits match HF for the same weights. Attention itself is delegated to a
backend (tandem/models/attention.py), which is how training and the paged generator
share this one model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import batch_invariant
from tandem.models.args import ModelArgs
from tandem.models.attention import AttentionBackend, CausalAttention, attend
from tandem.models.linear_attention import GatedDeltaNet
from tandem.models.mla import MLAttention
from tandem.models.mlp import FeedForward, linear_of
from tandem.models.moe import MoE
from tandem.models.rope import RotaryEmbedding, apply_rotary

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics; the weight multiplies in the input dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)`` with h = x in fp32, through
        # F.rms_norm (fewer dispatches; the same values and gradients as the steps written out).
        # F.rms_norm applies the weight before rounding, so lower precisions round first here.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: ``(x_hat * (1 + w))`` in fp32, rounded to x's dtype; w starts at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def norm_class(args: ModelArgs) -> type[RMSNorm]:
    """The family's RMSNorm (zero-centred for Qwen3.5)."""
    return ZeroCenteredRMSNorm if args.linear is not None else RMSNorm


class Attention(nn.Module):
    """Projections, q/k-norm and RoPE around an attention backend.

    ``layer_id`` is passed to the backend so a KV-cache backend knows its layer; a GPT-OSS
    layer also passes its ``sinks [Hq]`` and sliding ``window`` (`tandem.models.attention.attend`).
    Qwen3.5's (``gated``): ``wq`` gives each head's query and an output gate side by side, the
    output is multiplied by ``sigmoid(gate)``, and RoPE turns the first ``rope_dim`` features.
    """

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        d, hd = args.hidden_size, args.head_dim
        self.gated, self.rope_dim = args.linear is not None, args.rope_dim
        q_width = args.num_heads * hd * (2 if self.gated else 1)
        self.wq = nn.Linear(d, q_width, bias=args.qkv_bias)
        self.wk = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.num_heads * hd, d, bias=args.has_biases)
        self.sinks = nn.Parameter(torch.empty(args.num_heads)) if args.attention_sinks else None
        self.window = args.window(layer_id)
        norm = norm_class(args)
        self.q_norm = norm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(hd, args.rms_norm_eps) if args.qk_norm else None
        self.wqkv: nn.Linear | None = None  # q, k and v in one (`fuse`)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        b, s, _ = x.shape  # [B, S, D]
        if self.wqkv is not None:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.wqkv(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        gate = None
        if self.gated:  # [B, S, Hq, 2 * Dh]: query, gate
            q, gate = q.view(b, s, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim)  # [B, S, Hq, Dh]
        k = k.view(b, s, self.num_kv_heads, self.head_dim)  # [B, S, Hkv, Dh]
        v = v.view(b, s, self.num_kv_heads, self.head_dim)  # [B, S, Hkv, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        out = attend(attn, self.layer_id, q, k, v, self.sinks, self.window)  # [B, S, Hq, Dh]
        out = out.reshape(b, s, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * batch_invariant.lane_aligned(torch.sigmoid, gate.reshape(b, s, -1))
        return self.wo(out)  # [B, S, D]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        turned, kept = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary(turned, cos, sin), kept], dim=-1)

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference layout: wq, wk and wv become one projection ``wqkv`` (q, k, v rows); a
        gated layer keeps its projections."""
        if self.wqkv is not None or self.gated:
            return
        parts = (self.wq, self.wk, self.wv)
        w = torch.cat([p.weight for p in parts])
        bias = torch.cat([p.bias for p in parts]) if self.wq.bias is not None else None
        del self.wq, self.wk, self.wv
        self.wqkv = linear_of(w, bias)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        norm = norm_class(args)
        self.attention_norm = norm(args.hidden_size, args.rms_norm_eps)
        self.attention: nn.Module
        if args.is_mla:
            self.attention = MLAttention(args, layer_id, RMSNorm)
        elif args.is_linear_layer(layer_id):
            self.attention = GatedDeltaNet(args, layer_id)
        else:
            self.attention = Attention(args, layer_id)
        self.ffn_norm = norm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.hidden_size, args.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """The full model; see the module docstring for the layout contract."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rope = RotaryEmbedding(args)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, i) for i in range(args.num_layers)}
        )
        self.norm: RMSNorm | None = norm_class(args)(args.hidden_size, args.rms_norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the very tensor ``tok_embeddings.weight`` when tied."""
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # type: ignore[override]
        # `to_empty` (meta -> real) builds a fresh Parameter per module, which unties
        # shared weights; re-tie so tied models stay tied after materialisation.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def fuse_projections(self) -> Transformer:
        """Inference layout, in place: each block's q/k/v projections become one matmul, and
        its gate/up projections another (the same values up to summation order). The
        state dict then has ``wqkv``/``w13`` keys instead of HF's, and parallel/'s plans
        no longer apply: this is for a generation copy, never for training or checkpoints.
        A second call changes nothing."""
        for block in self.layers.values():
            block.attention.fuse()
            ffn = block.moe.shared_experts if hasattr(block, "moe") else block.feed_forward
            if ffn is not None:
                ffn.fuse()
        return self

    def unfused_views(self) -> dict[str, torch.Tensor]:
        """This model's tensors under the unfused (HF-layout) state-dict names: a fused q/k/v
        or gate/up weight (`fuse_projections`) appears as its row blocks. They are views, so
        writing into them refills the model in place (a generation copy given new weights
        keeps its tensors, and anything that holds them)."""
        out = {k: v.detach() for k, v in self.state_dict(keep_vars=True).items()}
        for lid, block in self.layers.items():
            att, pre = block.attention, f"layers.{lid}.attention."
            if att.wqkv is not None:
                kv = att.num_kv_heads * att.head_dim
                sizes = [att.num_heads * att.head_dim, kv, kv]
                for kind in ("weight", "bias"):
                    fused = out.pop(f"{pre}wqkv.{kind}", None)
                    if fused is not None:
                        for name, part in zip(("wq", "wk", "wv"), fused.split(sizes)):
                            out[f"{pre}{name}.{kind}"] = part
            moe = hasattr(block, "moe")
            ffn = block.moe.shared_experts if moe else block.feed_forward
            pre = f"layers.{lid}." + ("moe.shared_experts." if moe else "feed_forward.")
            if ffn is not None and ffn.w13 is not None:
                w1, w3 = out.pop(f"{pre}w13.weight").chunk(2)
                out[f"{pre}w1.weight"], out[f"{pre}w3.weight"] = w1, w3
        return out

    def reset_rope(self) -> None:
        """Recompute the RoPE frequency buffer (non-persistent, so never in checkpoints)."""
        self.rope.reset()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """From-scratch init: N(0, 0.02) weights, zero biases, unit norms, fresh RoPE.

        Works on a model materialised with ``to_empty``. With ``seed`` the result is
        reproducible (for a given device type); without it the global RNG is used.
        """
        self.tie_weights()
        params = list(self.parameters())
        device = params[0].device if params else torch.device("cpu")
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD, generator=gen)
            elif isinstance(module, nn.Linear):
                if not (module is self.output and self.args.tie_word_embeddings):
                    nn.init.normal_(module.weight, mean=0.0, std=INIT_STD, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MoE):
                module.init_weights(INIT_STD, gen)
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.zeros_(module.sinks)
            elif isinstance(module, GatedDeltaNet):
                module.init_weights(INIT_STD, gen)
        self.reset_rope()

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
        return_hidden: bool = False,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> Any:
        """x: token ids ``[B, S]``, or hidden ``[B, S, D]`` (a float tensor, or any x when
        tok_embeddings is None). positions ``[B, S]``, or ``[3, B, S]`` with M-RoPE.

        Returns logits ``[B, S, V]``, or hidden ``[B, S, D]`` (after the final norm,
        if this stage has one) when ``return_hidden`` or ``output is None``.
        ``head(hidden, output_weight)``, when given, replaces the output
        projection and its result is returned: a loss can then read the vocab
        projection without full logits ever existing, while the weight is
        still live inside this forward (wrappers that gather parameters for
        the forward only keep it that long).
        """
        embed = self.tok_embeddings is not None and not x.is_floating_point()
        h = self.tok_embeddings(x) if embed else x  # [B, S, D]
        b, s = h.shape[:2]
        if positions is None:
            positions = torch.arange(s, device=h.device).expand(b, s)  # [B, S]
        if attn is None:
            attn = CausalAttention()
        cos, sin = self.rope(positions, h.dtype)  # [B, S, Dh] each
        for layer in self.layers.values():
            h = layer(h, cos, sin, attn)
        if self.norm is not None:
            h = self.norm(h)
        if return_hidden or self.output is None:
            return h
        if head is not None:
            return head(h, self.output.weight)
        return self.output(h)  # [B, S, V]
