"""Qwen3.5's Hugging Face layout (``qwen3_5_text``): ``config.json`` fields, checks, sizes.

The model is tandem/models/transformer.py with two kinds of token mixer, by ``layer_types``:
"linear_attention" layers are gated DeltaNet (tandem/models/linear_attention.py: a short
causal convolution, the gated delta rule of tandem/kernels/gated_delta.py, a gated RMSNorm),
"full_attention" layers are the usual attention with q/k-norm, RoPE on the first
``partial_rotary_factor`` of each head only, and an output gate (``q_proj`` gives each head's
query and gate side by side; the attention output is multiplied by ``sigmoid(gate)``). Every
RMSNorm outside the DeltaNet is zero-centred (``x_hat * (1 + w)``). Tensors keep HF's names
(``linear_attn.*`` -> ``attention.*``) through tandem/models/hf.py's table, so a folder exports
bit for bit. Qwen3.5-MoE (``qwen3_5_moe_text``) has the MoE block (tandem/models/moe.py) in
every layer: softmax routing renormalised over the chosen experts and a shared expert gated by
a sigmoid, as Qwen2-MoE's (one tensor per expert on disk, as transformers writes them). Only
the text models are read: ``qwen3_5`` / ``qwen3_5_moe`` folders (the vision tower beside the LM,
``model.language_model.*``) are follow-up work (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.models.args import ModelArgs

MODEL_TYPE = "qwen3_5_text"
MOE_MODEL_TYPE = "qwen3_5_moe_text"  # every layer's MLP the MoE block, with a gated shared expert
MODEL_TYPES = (MODEL_TYPE, MOE_MODEL_TYPE)
LINEAR = "linear_attention"


@dataclass(frozen=True)
class LinearArgs:
    """A gated DeltaNet layer's sizes (HF's ``linear_*`` keys)."""

    conv_kernel: int = 4
    key_head_dim: int = 128
    value_head_dim: int = 128
    num_key_heads: int = 16
    num_value_heads: int = 32

    @property
    def key_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def value_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_numel(self) -> tuple[int, int]:
        """Entries of one sequence's state in one layer: (conv inputs, delta-rule matrix)."""
        matrix = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return (self.conv_kernel - 1) * self.conv_dim, matrix


def reject_unsupported(config: dict[str, Any]) -> None:
    """Refuse Qwen3.5 options the model does not implement instead of loading them wrongly."""
    if config.get("attention_bias"):
        raise ValueError("qwen3_5_text with attention_bias=True is not supported")


def fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`ModelArgs` fields (layer kinds, DeltaNet sizes, partial RoPE) from a ``config.json``."""
    layers = config["num_hidden_layers"]
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or [
        LINEAR if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    params = config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    moe = {}
    if config["model_type"] == MOE_MODEL_TYPE:
        moe = {
            "num_experts": config["num_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "norm_topk_prob": True,
            "shared_expert_intermediate_size": config["shared_expert_intermediate_size"],
            "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
            "router_z_loss_coef": config.get("router_z_loss_coef", 0.0),
        }
    return {
        **moe,
        "layer_types": list(types),
        "partial_rotary_factor": float(factor),
        "linear": LinearArgs(
            conv_kernel=config.get("linear_conv_kernel_dim", 4),
            key_head_dim=config.get("linear_key_head_dim", 128),
            value_head_dim=config.get("linear_value_head_dim", 128),
            num_key_heads=config.get("linear_num_key_heads", 16),
            num_value_heads=config.get("linear_num_value_heads", 32),
        ),
    }


def config_to_hf(args: ModelArgs, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3_5Text ``config.json``: ``cfg`` (the keys every family writes) plus its own."""
    lin = args.linear
    scaling = dict(args.rope_scaling or {"rope_type": "default"})
    for key in ("rope_theta", "rope_scaling", "use_sliding_window", "sliding_window"):
        cfg.pop(key, None)
    if args.is_moe:
        if args.intermediate_size != args.moe_intermediate_size or not args.norm_topk_prob:
            raise ValueError(
                "qwen3_5_moe_text has no dense layers (intermediate_size = moe_intermediate_size) "
                "and renormalises the chosen experts' weights (norm_topk_prob)"
            )
        cfg.pop("intermediate_size")
        cfg.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            shared_expert_intermediate_size=args.shared_expert_intermediate_size,
            router_aux_loss_coef=args.router_aux_loss_coef,
            router_z_loss_coef=args.router_z_loss_coef,  # Tandem's; transformers keeps it unread
            output_router_logits=False,
        )
    cfg.update(
        attention_bias=False,
        layer_types=list(args.layer_types),
        linear_conv_kernel_dim=lin.conv_kernel,
        linear_key_head_dim=lin.key_head_dim,
        linear_value_head_dim=lin.value_head_dim,
        linear_num_key_heads=lin.num_key_heads,
        linear_num_value_heads=lin.num_value_heads,
        rope_parameters={
            **scaling,
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
    )
    return cfg


def validate(args: ModelArgs) -> None:
    """Layer kinds and sizes of a `ModelArgs` (Qwen3.5's only: none for the other types)."""
    lin = args.linear
    if (args.model_type in MODEL_TYPES) != (lin is not None):
        raise ValueError(f"linear-attention sizes are Qwen3.5's, not {args.model_type!r}'s")
    if lin is None:
        return
    if lin is None or len(args.layer_types) != args.num_layers:
        raise ValueError(
            "qwen3_5_text needs linear-attention sizes and a layer_types entry a layer"
        )
    if lin.num_value_heads % lin.num_key_heads or min(lin.conv_kernel, lin.key_head_dim) < 1:
        raise ValueError(
            f"qwen3_5_text: linear value heads {lin.num_value_heads} must be a multiple of key "
            f"heads {lin.num_key_heads}, conv kernel and head dims >= 1"
        )
    if args.rope_dim % 2 or not 0 < args.rope_dim <= args.head_dim:
        raise ValueError(
            f"qwen3_5_text: head_dim {args.head_dim} x partial_rotary_factor "
            f"{args.partial_rotary_factor} must give an even rotary width"
        )


def linear_num_params(args: ModelArgs) -> int:
    """One gated DeltaNet layer's parameters: the four input projections, the depthwise
    convolution, ``A_log`` and ``dt_bias``, the gated norm and the output projection."""
    lin, d = args.linear, args.hidden_size
    hv = lin.num_value_heads
    proj = d * (lin.conv_dim + lin.value_dim + 2 * hv) + lin.value_dim * d
    return proj + lin.conv_dim * lin.conv_kernel + 2 * hv + lin.value_head_dim


def attention_matmul_params(args: ModelArgs, layer_id: int) -> int:
    """Layer ``layer_id``'s token-mixer matmul weights (a full layer's q carries its gate)."""
    if args.layer_types[layer_id] == LINEAR:
        lin = args.linear
        return args.hidden_size * (lin.conv_dim + 2 * lin.value_dim + 2 * lin.num_value_heads)
    d, h = args.hidden_size, args.head_dim
    return d * 2 * args.num_heads * h + 2 * d * args.num_kv_heads * h + args.num_heads * h * d
