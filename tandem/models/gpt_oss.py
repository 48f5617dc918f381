"""GPT-OSS's Hugging Face layout: ``config.json`` fields and the tensors that differ from Llama's.

The model itself is tandem/models/transformer.py with three switches of `ModelArgs`
(``attention_sinks``, ``layer_types`` / ``sliding_window``, ``swiglu_limit``) and
``moe_score_func = "softmax_topk"``; this file only translates. On disk an MoE layer holds

- ``mlp.router.weight [E, D]`` / ``mlp.router.bias [E]``: here ``moe.gate`` (an ``nn.Linear``);
- ``mlp.experts.gate_up_proj [E, D, 2I]``: gate and up *interleaved* along the last dim
  (column ``2j`` is gate feature ``j``, ``2j + 1`` up feature ``j``), stored input-major; here
  ``experts.w1`` / ``experts.w3 [E, I, D]`` (de-interleaved and transposed, as every other
  family's stacked experts), with ``gate_up_proj_bias [E, 2I]`` split the same way into
  ``experts.b1`` / ``experts.b3 [E, I]``;
- ``mlp.experts.down_proj [E, I, D]`` / ``down_proj_bias [E, D]``: here ``experts.w2 [E, D, I]``
  and ``experts.b2``.

Loading takes strided views and saving interleaves them back, so an exported folder is the
loaded one bit for bit. MXFP4 checkpoints (``quantization_config``) are refused: bf16 / fp32
weights only.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.models.args import ModelArgs

_HF = re.compile(
    r"model\.layers\.(?P<i>\d+)\.mlp\.(?P<what>router\.weight|router\.bias|experts\.gate_up_proj"
    r"|experts\.gate_up_proj_bias|experts\.down_proj|experts\.down_proj_bias)$"
)
_TANDEM = re.compile(
    r"layers\.(?P<i>\d+)\.moe\.(?P<what>gate\.weight|gate\.bias|experts\.[wb][123])$"
)


def reject_unsupported(config: dict[str, Any]) -> None:
    """Refuse GPT-OSS options the model does not implement instead of loading them wrongly."""
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method")
        raise ValueError(
            f"gpt_oss checkpoint quantized with {method!r}: only bf16 / fp32 weights load "
            "(dequantize the folder first)"
        )
    if not config.get("attention_bias", True):
        raise ValueError("gpt_oss with attention_bias=False is not supported")


def fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`ModelArgs` fields (MoE, windows, sinks, activation) from a GptOss ``config.json``."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    window = config.get("sliding_window")
    return {
        "num_experts": config["num_local_experts"],
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["intermediate_size"],
        "moe_score_func": "softmax_topk",
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
        "router_z_loss_coef": config.get("router_z_loss_coef", 0.0),
        "sliding_window": int(window or 0),
        "layer_types": list(types),
        "attention_sinks": True,
        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
    }


def config_to_hf(args: ModelArgs, cfg: dict[str, Any]) -> dict[str, Any]:
    """The GptOss ``config.json``: ``cfg`` (the keys every family writes) plus its own."""
    scaling = dict(args.rope_scaling or {"rope_type": "default"})
    cfg.update(
        intermediate_size=args.moe_intermediate_size,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        router_aux_loss_coef=args.router_aux_loss_coef,
        router_z_loss_coef=args.router_z_loss_coef,  # Tandem's; transformers keeps it unread
        output_router_logits=False,
        sliding_window=args.sliding_window or None,
        layer_types=list(args.layer_types) or ["full_attention"] * args.num_layers,
        attention_bias=True,
        swiglu_limit=args.swiglu_limit,
        swiglu_alpha=args.swiglu_alpha,
        rope_parameters={**scaling, "rope_theta": args.rope_theta},  # transformers 5's key
    )
    return cfg


def hf_to_tandem(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pop GPT-OSS's router and expert tensors out of ``sd`` (HF names); return them under
    Tandem's names (strided views, see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name in [n for n in sd if _HF.match(n)]:
        m, t = _HF.match(name), sd.pop(name)
        pre = f"layers.{m['i']}.moe."
        what = m["what"]
        if what.startswith("router."):
            out[pre + "gate." + what.removeprefix("router.")] = t
        elif what == "experts.gate_up_proj":  # [E, D, 2I] -> [E, I, D] each
            out[pre + "experts.w1"] = t[..., 0::2].transpose(1, 2)
            out[pre + "experts.w3"] = t[..., 1::2].transpose(1, 2)
        elif what == "experts.gate_up_proj_bias":  # [E, 2I] -> [E, I] each
            out[pre + "experts.b1"], out[pre + "experts.b3"] = t[:, 0::2], t[:, 1::2]
        elif what == "experts.down_proj":  # [E, I, D] -> [E, D, I]
            out[pre + "experts.w2"] = t.transpose(1, 2)
        else:
            out[pre + "experts.b2"] = t
    return out


def tandem_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pop the router and expert tensors out of ``sd`` (Tandem names); return them in HF's
    layout (new tensors: gate and up interleaved back)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name in [n for n in sd if _TANDEM.match(n)]:
        m = _TANDEM.match(name)
        parts.setdefault(m["i"], {})[m["what"]] = sd.pop(name)
    out: dict[str, torch.Tensor] = {}
    for i, p in parts.items():
        pre = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if f"gate.{kind}" in p:
                out[f"{pre}router.{kind}"] = p[f"gate.{kind}"]
        w1, w3 = p["experts.w1"], p["experts.w3"]  # [E, I, D]
        e, inter, d = w1.shape
        gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=-1)  # [E, D, I, 2]
        out[pre + "experts.gate_up_proj"] = gate_up.reshape(e, d, 2 * inter)
        b13 = torch.stack([p["experts.b1"], p["experts.b3"]], dim=-1)  # [E, I, 2]
        out[pre + "experts.gate_up_proj_bias"] = b13.reshape(e, 2 * inter)
        out[pre + "experts.down_proj"] = p["experts.w2"].transpose(1, 2).contiguous()
        out[pre + "experts.down_proj_bias"] = p["experts.b2"].clone()
    return out


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """GPT-OSS's expert activation: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, l)`` (the same operations, in the same order, as the released model)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
