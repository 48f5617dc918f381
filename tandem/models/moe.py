"""Mixture-of-experts feed-forward block (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3-style routing).

``MoE`` replaces the dense SwiGLU `FeedForward` in the layers `ModelArgs.is_moe_layer`
picks: a router chooses ``k`` experts per token (softmax or sigmoid scores, an optional
DeepSeek-V3 selection bias), the experts are SwiGLUs stacked as 3-D parameters (dim 0
shards under expert parallelism) run dropless through
`tandem.kernels.grouped_gemm.grouped_mm`, plus an optional shared expert. Each forward
records its routing, tokens per expert and the auxiliary and z losses as attributes of the
block; ``token_mask`` keeps padding out of them. GPT-OSS's variant (``moe_score_func =
"softmax_topk"``): the router has a bias and softmaxes the ``k`` largest logits only, and
each expert has biases and the clamped SwiGLU of tandem/models/gpt_oss.py. The formulas:
docs/models.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.batch_invariant import lane_aligned
from tandem.kernels.grouped_gemm import grouped_mm, permute_tokens, unpermute_tokens
from tandem.models.args import ModelArgs
from tandem.models.gpt_oss import clamped_swiglu
from tandem.models.mlp import FeedForward


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts with stacked weights; `forward` runs pre-sorted tokens.

    ``bias``: each projection adds its expert's bias (``b1``/``b3`` ``[E, I]``, ``b2`` ``[E,
    D]``); ``limit > 0``: GPT-OSS's clamped activation (`clamped_swiglu`) instead of SiLU."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        bias: bool = False,
        limit: float = 0.0,
        alpha: float = 1.702,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate [E, I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down [E, D, I]
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up   [E, I, D]
        self.limit, self.alpha = limit, alpha
        self.b1 = self.b2 = self.b3 = None
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden))  # [E, I]
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))  # [E, D]
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden))  # [E, I]

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x_sorted ``[R, D]`` grouped by expert (``offsets`` ``[E]`` int32 cumulative) ->
        ``[R, D]``."""
        gate = grouped_mm(x_sorted, self.w1.transpose(1, 2), offsets)  # [R, I]
        up = grouped_mm(x_sorted, self.w3.transpose(1, 2), offsets)  # [R, I]
        if self.b1 is None:
            h = lane_aligned(F.silu, gate) * up
            return grouped_mm(h, self.w2.transpose(1, 2), offsets)  # [R, D]
        rows = torch.arange(x_sorted.shape[0], device=offsets.device)
        expert = torch.searchsorted(offsets, rows.to(offsets.dtype), right=True)  # [R]
        gate, up = gate + self.b1[expert], up + self.b3[expert]
        h = clamped_swiglu(gate, up, self.limit, self.alpha) if self.limit else F.silu(gate) * up
        return grouped_mm(h, self.w2.transpose(1, 2), offsets) + self.b2[expert]  # [R, D]

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, mean=0.0, std=std, generator=generator)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)


class MoE(nn.Module):
    """Router + grouped experts (+ shared expert); see the module docstring."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d, e = args.hidden_size, args.num_experts
        self.num_experts, self.top_k = e, args.num_experts_per_tok
        self.norm_topk_prob, self.score_func = args.norm_topk_prob, args.moe_score_func
        self.route_scale = args.moe_route_scale
        self.n_group, self.topk_group = args.moe_n_group, args.moe_topk_group
        self.gate = nn.Linear(d, e, bias=args.has_biases)  # router [E, D]
        self.experts = GroupedExperts(
            e,
            d,
            args.moe_intermediate_size,
            bias=args.has_biases,
            limit=args.swiglu_limit,
            alpha=args.swiglu_alpha,
        )
        self.shared_experts: FeedForward | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if args.shared_expert_intermediate_size:
            self.shared_experts = FeedForward(d, args.shared_expert_intermediate_size)
            if args.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(d, 1, bias=False)
        bias = torch.zeros(e, dtype=torch.float32) if self.score_func == "sigmoid" else None
        self.register_buffer("expert_bias", bias)  # [E] fp32, or None (not in the state dict)
        # [B, S] bool, set by the caller: the real tokens
        self.token_mask: torch.Tensor | None = None
        self.last_routing: torch.Tensor | None = None  # [T, k] int64
        self.tokens_per_expert: torch.Tensor | None = None  # [E] int64
        self.aux_loss: torch.Tensor | None = None  # scalar fp32
        self.z_loss: torch.Tensor | None = None  # scalar fp32

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` -> (logits ``[T, E]``, scores ``[T, E]`` fp32, ids ``[T, k]``, weights ``[T,
        k]`` fp32)."""
        logits = self.gate(x)  # [T, E]
        if self.score_func == "softmax_topk":  # GPT-OSS: softmax over the chosen logits only
            top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
            weights = torch.softmax(top, dim=-1, dtype=top.dtype).float()
            return logits, torch.softmax(logits.float(), dim=-1), ids, weights * self.route_scale
        if self.score_func == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:  # DeepSeek-V3: only experts of the best topk_group groups
            t, per = choice.shape[0], self.num_experts // self.n_group
            best = choice.view(t, self.n_group, per).topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, ids)  # [T, k], unbiased
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, scores, ids, weights * self.route_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [B, S, D]
        flat = x.reshape(-1, shape[-1])  # [T, D]
        logits, scores, ids, weights = self.route(flat)
        order, offsets = permute_tokens(ids, self.num_experts)  # [T*k], [E]
        x_sorted = flat[order // self.top_k]  # [T*k, D]
        out = unpermute_tokens(self.experts(x_sorted, offsets), order, weights)  # [T, D]
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)  # [T, D]
            if self.shared_expert_gate is not None:
                shared = lane_aligned(torch.sigmoid, self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.token_mask is None:
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()  # [E]
        else:  # the real tokens only (see the module docstring)
            keep = self.token_mask.reshape(-1)  # [T]
            ids_kept, scores, logits = ids[keep], scores[keep], logits[keep]
            counts = torch.bincount(ids_kept.reshape(-1), minlength=self.num_experts)  # [E]
        self.last_routing, self.tokens_per_expert = ids.detach(), counts
        self.aux_loss = load_balancing_loss(scores, counts, self.score_func)
        self.z_loss = router_z_loss(logits)
        return out.view(shape)

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """The parameters `Transformer.init_weights`' ``nn.Linear`` pass does not reach."""
        self.experts.init_weights(std, generator)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def load_balancing_loss(
    scores: torch.Tensor, counts: torch.Tensor, score_func: str
) -> torch.Tensor:
    """``E * sum_e (counts_e / T) * mean_t p[t, e]``; scores ``[T, E]``, counts ``[E]``
    top-k hits."""
    t, e = scores.shape
    probs = scores if score_func != "sigmoid" else scores / scores.sum(dim=-1, keepdim=True)
    f = counts.to(torch.float32) / max(t, 1)  # [E]
    return e * (f * probs.float().mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` over router logits ``[T, E]`` (fp32)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The MoE blocks of a model by layer key ("0", "1", ...; those present on this stage)."""
    layers = getattr(model, "layers", None) or {}
    return {
        key: layer.moe for key, layer in layers.items() if getattr(layer, "moe", None) is not None
    }


def set_token_mask(model: nn.Module, mask: torch.Tensor | None) -> None:
    """Tell every MoE block of ``model`` which of the next forward's ``[B, S]`` positions are real
    tokens (None: all of them); see the module docstring."""
    for m in moe_layers(model).values():
        m.token_mask = mask


def router_loss(model: nn.Module) -> torch.Tensor | None:
    """``mean over MoE layers of (aux_coef * aux_loss + z_coef * z_loss)`` from the last forward.

    None when the model has no MoE layer (or none ran). The coefficients are the
    model's `ModelArgs.router_aux_loss_coef` / ``router_z_loss_coef``.
    """
    args: ModelArgs = model.args
    terms = [
        args.router_aux_loss_coef * m.aux_loss + args.router_z_loss_coef * m.z_loss
        for m in moe_layers(model).values()
        if m.aux_loss is not None
    ]
    return torch.stack(terms).mean() if terms else None
