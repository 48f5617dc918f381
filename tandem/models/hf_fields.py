"""The per-family parts of reading a Hugging Face ``config.json`` into `ModelArgs`
(tandem/models/args.py): the MoE fields and the options Tandem refuses."""

from __future__ import annotations

from typing import Any

from tandem.models import deepseek, gpt_oss, qwen3_5

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", qwen3_5.MOE_MODEL_TYPE)


def hf_moe_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelArgs' MoE fields from an HF Qwen2-MoE / Qwen3-MoE config (none for dense types)."""
    if model_type not in MOE_MODEL_TYPES or model_type == qwen3_5.MOE_MODEL_TYPE:
        return {}  # (Qwen3.5-MoE's come with its other fields: qwen3_5.fields_from_hf)
    if model_type == "gpt_oss":
        return gpt_oss.fields_from_hf(config)
    if model_type == "deepseek_v3":
        return deepseek.fields_from_hf(config)
    fields = {
        # transformers 5 writes Qwen3-MoE's count as num_local_experts; checkpoints have
        # num_experts.
        "num_experts": config.get("num_experts") or config.get("num_local_experts") or 0,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": list(config.get("mlp_only_layers") or []),
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
        "router_z_loss_coef": config.get("router_z_loss_coef", 0.0),
    }
    if model_type == "qwen2_moe":  # Qwen3-MoE configs may carry the key, unused
        fields["shared_expert_intermediate_size"] = config["shared_expert_intermediate_size"]
    return fields


def reject_unsupported_hf_features(config: dict[str, Any], model_type: str) -> None:
    """Refuse HF options our modules do not implement instead of loading them wrongly."""
    family = model_type.removesuffix("_moe")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}; only 'silu'")
    if family in ("llama", "qwen3") and config.get("attention_bias"):
        raise ValueError(f"{model_type} with attention_bias=True is not supported")
    if model_type == "qwen2_moe" and not config.get("qkv_bias", True):
        raise ValueError("qwen2_moe with qkv_bias=False is not supported")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if model_type == "gpt_oss":
        gpt_oss.reject_unsupported(config)
    if model_type == "deepseek_v3":
        deepseek.reject_unsupported(config)
    if model_type in qwen3_5.MODEL_TYPES:
        qwen3_5.reject_unsupported(config)
