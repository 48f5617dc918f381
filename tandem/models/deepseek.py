"""DeepSeek-V3's Hugging Face layout (``deepseek_v3``): ``config.json`` fields and checks.

The model is tandem/models/transformer.py with multi-head latent attention
(tandem/models/mla.py) in every layer, dense SwiGLU in the first ``first_k_dense_replace``
layers (``mlp_only_layers``) and, after them, the MoE block with an ungated shared expert and
the sigmoid router whose per-expert correction bias (``e_score_correction_bias``, Tandem's
``expert_bias`` buffer) steers the choice only, limited to the ``topk_group`` best of
``n_group`` expert groups (a group scores the sum of its two best biased scores). Tensors keep
HF's names through tandem/models/hf.py's table; routed experts are one tensor per expert on
disk as for Qwen-MoE. Multi-token-prediction layers (``num_nextn_predict_layers``; layer
indices past ``num_hidden_layers``) are not part of the model transformers builds either:
loading skips them, so an export does not carry them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.models.args import ModelArgs

MLA_NORM_EPS = 1e-6  # the q / kv latent RMSNorms' epsilon (DeepSeek-V3 hard-wires it)


def reject_unsupported(config: dict[str, Any]) -> None:
    """Refuse DeepSeek options the model does not implement instead of loading them wrongly."""
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method")
        raise ValueError(
            f"deepseek_v3 checkpoint quantized with {method!r}: only bf16 / fp32 weights load "
            "(dequantize the folder first)"
        )
    if config.get("attention_bias"):
        raise ValueError("deepseek_v3 with attention_bias=True is not supported")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"deepseek_v3 topk_method {config['topk_method']!r}: only 'noaux_tc'")


def fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`ModelArgs` fields (MLA sizes, MoE layout and router) from a DeepseekV3 ``config.json``."""
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    experts = config.get("n_routed_experts") or 0
    return {
        "head_dim": nope + rope,  # the decompressed key's width (config's head_dim is rope's)
        "num_kv_heads": config["num_attention_heads"],
        "q_lora_rank": config.get("q_lora_rank") or 0,
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_rope_head_dim": rope,
        "v_head_dim": config["v_head_dim"],
        "rope_interleave": bool(config.get("rope_interleave", True)),
        "num_experts": experts,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": config["moe_intermediate_size"]
        * (config.get("n_shared_experts") or 0),
        "mlp_only_layers": list(range(min(config.get("first_k_dense_replace") or 0, 10**6))),
        "moe_score_func": "sigmoid",
        "moe_route_scale": float(config.get("routed_scaling_factor", 1.0)),
        "moe_n_group": config.get("n_group") or 1,
        "moe_topk_group": config.get("topk_group") or 1,
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.0),
        "router_z_loss_coef": config.get("router_z_loss_coef", 0.0),
    }


def config_to_hf(args: ModelArgs, cfg: dict[str, Any]) -> dict[str, Any]:
    """The DeepseekV3 ``config.json``: ``cfg`` (the keys every family writes) plus its own."""
    dense = list(range(len(args.mlp_only_layers)))
    if args.mlp_only_layers != dense or args.shared_expert_intermediate_size % max(
        args.moe_intermediate_size, 1
    ):
        raise ValueError(
            "deepseek_v3 exports dense layers 0..k-1 only (first_k_dense_replace) and a shared "
            "expert of a whole number of experts' width"
        )
    scaling = dict(args.rope_scaling or {"rope_type": "default"})
    cfg.update(
        head_dim=args.qk_rope_head_dim,  # transformers' meaning: the rotary part's width
        q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.head_dim - args.qk_rope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        rope_interleave=args.rope_interleave,
        n_routed_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        moe_intermediate_size=args.moe_intermediate_size,
        n_shared_experts=args.shared_expert_intermediate_size // args.moe_intermediate_size,
        first_k_dense_replace=len(dense),
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=args.moe_route_scale,
        n_group=args.moe_n_group,
        topk_group=args.moe_topk_group,
        topk_method="noaux_tc",
        router_aux_loss_coef=args.router_aux_loss_coef,  # Tandem's; transformers keeps it unread
        router_z_loss_coef=args.router_z_loss_coef,
        num_nextn_predict_layers=0,
        attention_bias=False,
        rope_parameters={**scaling, "rope_theta": args.rope_theta},
    )
    return cfg


def validate(args: ModelArgs) -> None:
    """The MLA sizes and the grouped router of a ``deepseek_v3`` `ModelArgs`."""
    rope, v = args.qk_rope_head_dim, args.v_head_dim
    if not 0 < rope < args.head_dim or rope % 2 or args.kv_lora_rank < 1:
        raise ValueError(
            "deepseek_v3 needs 0 < qk_rope_head_dim (even) < head_dim (nope + rope) and "
            f"kv_lora_rank >= 1; got {rope}, {args.head_dim}, {args.kv_lora_rank}"
        )
    if not 0 < v <= args.head_dim or args.num_kv_heads != args.num_heads:
        raise ValueError(
            "deepseek_v3 keeps decompressed K/V per head: v_head_dim <= head_dim and "
            f"num_kv_heads == num_heads; got {v}, {args.head_dim}, {args.num_kv_heads}"
        )
    g, k = args.moe_n_group, args.moe_topk_group
    if args.num_experts % g or args.num_experts // g < 2 or not 1 <= k <= g:
        raise ValueError(
            f"n_group {g} must divide num_experts {args.num_experts} into groups of >= 2 "
            f"experts, and 1 <= topk_group ({k}) <= n_group"
        )


def mla_num_params(args: ModelArgs, norms: bool = True) -> int:
    """One MLA layer's parameters: q (low-rank with its norm, or full), the kv down-projection
    with the rotary key, its norm, the kv up-projection, o (``norms=False``: matmuls only)."""
    d, h, qk, n = args.hidden_size, args.num_heads, args.head_dim, int(norms)
    nope = qk - args.qk_rope_head_dim
    q = d * h * qk if not args.q_lora_rank else args.q_lora_rank * (d + n + h * qk)
    kv = d * (args.kv_lora_rank + args.qk_rope_head_dim) + n * args.kv_lora_rank
    return q + kv + args.kv_lora_rank * h * (nope + args.v_head_dim) + h * args.v_head_dim * d
