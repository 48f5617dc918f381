"""Model hyper-parameters shared by every decoder-only family Tandem trains.

One dataclass covers Llama-3, Qwen2 and Qwen3: the families differ only in
whether q/k/v projections carry a bias (Qwen2), whether q and k get a per-head
RMSNorm before RoPE (Qwen3), and their RoPE scaling. The mixture-of-experts
families Qwen2-MoE and Qwen3-MoE share their dense sibling's attention and add
the ``num_experts`` ... ``router_*`` fields (tandem/models/moe.py). `from_hf` / `to_hf`
map to and from a Hugging Face ``config.json`` dict so checkpoints travel both ways.
Qwen2.5-VL (``qwen2_5_vl``) is a Qwen2 LM with M-RoPE (``mrope_section``) and a vision
tower (``vision``, tandem/models/vision.py; the model is tandem/models/vlm.py).
GPT-OSS (``gpt_oss``) adds attention sinks, sliding-window layers, biased projections and
MoE with router and expert biases and a clamped SwiGLU (tandem/models/gpt_oss.py maps its
``config.json``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.models import deepseek, gpt_oss, qwen3_5
from tandem.models.hf_fields import MOE_MODEL_TYPES, hf_moe_fields, reject_unsupported_hf_features
from tandem.models.vision import VisionArgs

MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_5_vl", "gpt_oss", "deepseek_v3",
    "qwen3_5_text", "qwen3_5_moe_text",
)  # fmt: skip
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
VLM_MODEL_TYPES = ("qwen2_5_vl",)
_FAMILY = {
    "qwen2_5_vl": "qwen2",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}  # the dense family whose attention a model type uses
# "softmax_topk": GPT-OSS's router, a softmax over the k largest logits only
SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk")
# RoPE variants we implement; anything else is rejected rather than silently run unscaled.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass
class ModelArgs:
    """Architecture of one decoder-only transformer.

    ``head_dim`` of ``None`` derives ``hidden_size // num_heads``; ``num_kv_heads``
    of ``None`` means multi-head attention; ``qkv_bias`` / ``qk_norm`` of ``None``
    take the family's value (Qwen2: bias, Qwen3: qk-norm, Llama: neither).
    ``rope_scaling`` is the HF dict (``{"rope_type": "llama3", "factor": ...}``) or None.

    Mixture of experts (``qwen2_moe`` / ``qwen3_moe``; HF's key names): layer ``i`` is
    an MoE layer unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
    dense layers keep an ``intermediate_size`` SwiGLU. ``num_experts_per_tok`` of the
    ``num_experts`` experts (``moe_intermediate_size`` each) run per token, weighted by
    the router's scores (renormalised over the chosen ones with ``norm_topk_prob``).
    ``shared_expert_intermediate_size > 0`` adds an always-on expert, gated by a
    sigmoid in Qwen2-MoE and ungated otherwise (DeepSeek-V3's layout).
    ``moe_score_func="sigmoid"`` is DeepSeek-V3's router: sigmoid scores, a per-expert
    bias added for the choice only, ``moe_route_scale`` times the weights. Qwen3-MoE
    with a shared expert, sigmoid scores or a route scale has no HF layout (`to_hf`
    raises). The trainer adds ``router_aux_loss_coef`` times the load-balancing loss
    and ``router_z_loss_coef`` times the router z-loss (`tandem.models.moe.router_loss`).

    Vision-language (``qwen2_5_vl``): ``vision`` is the tower's config and token ids, and
    ``mrope_section`` the (time, row, column) split of the ``head_dim // 2`` RoPE frequencies.

    GPT-OSS (``gpt_oss``): ``layer_types[i]`` is "sliding_attention" (a query attends to the
    ``sliding_window`` latest keys, itself included) or "full_attention" (empty: all full);
    ``attention_sinks`` adds a learned per-head logit to each softmax's denominator; q/k/v/o
    carry biases, the router a bias, each expert biases, and the experts' activation is
    ``(clamp(up, +-l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``
    (``swiglu_limit`` l > 0, ``swiglu_alpha``); the router is ``moe_score_func="softmax_topk"``.

    DeepSeek-V3 (``deepseek_v3``, tandem/models/deepseek.py, tandem/models/mla.py): multi-head
    latent attention with ``q_lora_rank`` (0: a full q projection), ``kv_lora_rank``, a rotary
    part of ``qk_rope_head_dim`` of each ``head_dim``-wide query / key (interleaved pairs when
    ``rope_interleave``) and values of ``v_head_dim``; ``num_kv_heads == num_heads`` (the keys
    and values are decompressed per head). The sigmoid router picks within the best
    ``moe_topk_group`` of ``moe_n_group`` expert groups.

    Qwen3.5 (``qwen3_5_text``, tandem/models/qwen3_5.py): ``layer_types[i]`` is
    "linear_attention" (gated DeltaNet of ``linear`` sizes) or "full_attention" (gated, RoPE on
    ``partial_rotary_factor`` of each head).
    """

    model_type: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    moe_score_func: str = "softmax"
    moe_route_scale: float = 1.0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    mrope_section: list[int] = field(default_factory=list)
    vision: VisionArgs | None = None
    sliding_window: int = 0
    layer_types: list[str] = field(default_factory=list)
    attention_sinks: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    moe_n_group: int = 1
    moe_topk_group: int = 1
    partial_rotary_factor: float = 1.0
    linear: qwen3_5.LinearArgs | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.family in ("qwen2", "gpt_oss")
        if self.qk_norm is None:
            self.qk_norm = self.family in ("qwen3", "qwen3_5")
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        self.layer_types = [str(t) for t in self.layer_types]
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = [int(i) for i in self.eos_token_id]
        self._validate()

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        # Each HF family hard-wires these; another combination could not be exported.
        want_bias = self.family in ("qwen2", "gpt_oss")
        want_norm = self.family in ("qwen3", "qwen3_5")
        if self.qkv_bias != want_bias or self.qk_norm != want_norm:
            raise ValueError(
                f"model_type {self.model_type!r} requires qkv_bias={want_bias} and "
                f"qk_norm={want_norm}, got qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm}"
            )
        rope_type(self.rope_scaling)  # raises on unsupported scaling
        self._validate_attention_kinds()
        if self.is_mla:
            deepseek.validate(self)
        elif self.kv_lora_rank or self.moe_n_group != 1:
            raise ValueError(
                f"model_type {self.model_type!r} has no latent attention or expert groups "
                "(DeepSeek-V3's, model_type 'deepseek_v3')"
            )
        qwen3_5.validate(self)
        self._validate_moe()
        self._validate_vision()

    def _validate_vision(self) -> None:
        if (self.vision is not None) != self.is_vlm:
            raise ValueError(
                f"model_type {self.model_type!r} "
                f"{'needs' if self.is_vlm else 'takes no'} vision settings"
            )
        if self.mrope_section and sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim / 2 = "
                f"{self.head_dim // 2}"
            )
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.vision.out_hidden_size} must equal the "
                f"LM's hidden_size {self.hidden_size}"
            )

    def _validate_attention_kinds(self) -> None:
        """GPT-OSS's sliding windows and sinks (the model type's, never another family's)."""
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or (self.layer_types and len(self.layer_types) != self.num_layers):
            raise ValueError(
                f"layer_types must list one of {LAYER_TYPES} for each of the {self.num_layers} "
                f"layers; got {self.layer_types}"
            )
        sliding = "sliding_attention" in self.layer_types
        if sliding and self.sliding_window < 1:
            raise ValueError(f"sliding layers need sliding_window >= 1, got {self.sliding_window}")
        if "linear_attention" in self.layer_types and self.linear is None:
            raise ValueError(f"model_type {self.model_type!r} has no linear-attention layers")
        oss = self.model_type == "gpt_oss"
        if not oss and (sliding or self.attention_sinks or self.swiglu_limit):
            raise ValueError(
                f"model_type {self.model_type!r} has no sliding layers, sinks or clamped SwiGLU "
                "(GPT-OSS's, model_type 'gpt_oss')"
            )
        if oss and (not self.attention_sinks or self.moe_score_func != "softmax_topk"):
            raise ValueError(
                "gpt_oss has attention sinks and moe_score_func 'softmax_topk'; got "
                f"{self.attention_sinks}, {self.moe_score_func!r}"
            )

    def window(self, layer_id: int) -> int | None:
        """Layer ``layer_id``'s sliding window in tokens, or None (full attention)."""
        if self.layer_types and self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def sinks_or_windows(self) -> bool:
        """Attention that a backend must be told about (sinks, sliding windows)."""
        return self.attention_sinks or "sliding_attention" in self.layer_types

    def is_linear_layer(self, layer_id: int) -> bool:
        """Qwen3.5: layer ``layer_id`` is gated DeltaNet (tandem/models/linear_attention.py)."""
        return bool(self.layer_types) and self.layer_types[layer_id] == qwen3_5.LINEAR

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, tandem/models/mla.py)."""
        return self.model_type == "deepseek_v3"

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: each head's whole ``head_dim``, or MLA's rotary part."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_biases(self) -> bool:
        """GPT-OSS: biased o projection, router and experts."""
        return self.model_type == "gpt_oss"

    def _validate_moe(self) -> None:
        if not self.is_moe:
            if self.num_experts:
                raise ValueError(
                    f"model_type {self.model_type!r} is dense; num_experts must be 0, "
                    f"got {self.num_experts} (use {self.model_type}_moe)"
                )
            return
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"{self.model_type} needs num_experts >= 1 and 1 <= "
                f"num_experts_per_tok <= num_experts; got {self.num_experts} and "
                f"{self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"moe_intermediate_size and decoder_sparse_step must be >= 1; got "
                f"{self.moe_intermediate_size} and {self.decoder_sparse_step}"
            )
        if self.moe_score_func not in SCORE_FUNCS:
            raise ValueError(
                f"moe_score_func must be one of {SCORE_FUNCS}, got {self.moe_score_func!r}"
            )
        if self.model_type == "qwen2_moe" and (
            self.shared_expert_intermediate_size < 1 or self.moe_score_func != "softmax"
        ):
            raise ValueError(
                "qwen2_moe has a gated shared expert "
                "(shared_expert_intermediate_size >= 1) and softmax routing; got "
                f"{self.shared_expert_intermediate_size}, {self.moe_score_func!r}"
            )

    # ------------------------------------------------------------------ MoE layout
    @property
    def family(self) -> str:
        """The dense family whose attention this model uses ("qwen3" for "qwen3_moe")."""
        return _FAMILY.get(self.model_type, self.model_type.removesuffix("_moe"))

    @property
    def is_vlm(self) -> bool:
        """A vision-language model (tandem/models/vlm.py): images enter as LM rows."""
        return self.model_type in VLM_MODEL_TYPES

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_MODEL_TYPES

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts (HF's rule, `mlp_only_layers` first)."""
        return (
            self.is_moe
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def shared_expert_gated(self) -> bool:
        """Qwen2-MoE scales its shared expert by ``sigmoid(x @ g)``; DeepSeek-V3 does not."""
        return self.model_type in ("qwen2_moe", qwen3_5.MOE_MODEL_TYPE)

    # ------------------------------------------------------------------ HF config
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported HF model_type {model_type!r} (architectures="
                f"{config.get('architectures')}); supported: {MODEL_TYPES}"
            )
        top, vision = config, None
        if model_type in VLM_MODEL_TYPES:  # text keys flat (older folders) or in text_config
            vision = VisionArgs.from_hf(config["vision_config"], config)
            config = {**config, **(config.get("text_config") or {})}
        reject_unsupported_hf_features(config, model_type)
        if model_type == qwen3_5.MOE_MODEL_TYPE:  # no dense layer: the experts' width stands in
            config = {"intermediate_size": config["moe_intermediate_size"], **config}
        mrope = _hf_mrope(config) if model_type in VLM_MODEL_TYPES else []
        theta, scaling = _hf_rope(config)
        if scaling is not None and scaling.get("rope_type") == "mrope":
            # transformers 4.x's name for it
            scaling = {
                k: v for k, v in scaling.items() if k not in ("rope_type", "mrope_section")
            } or None
        eos = config.get("eos_token_id")
        fields = dict(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or None,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(
                top.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
            ),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=[] if eos is None else eos,
            mrope_section=mrope,
            vision=vision,
        )
        if model_type in qwen3_5.MODEL_TYPES:
            fields.update(qwen3_5.fields_from_hf(config))
        return cls(**{**fields, **hf_moe_fields(config, model_type)})

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``AutoModelForCausalLM`` loads (4.x and 5.x)."""
        eos: int | list[int] | None = self.eos_token_id or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.family in ("llama", "qwen3"):
            cfg["attention_bias"] = False
        if self.model_type == "llama":
            cfg["mlp_bias"] = False
        if self.family in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
            cfg["sliding_window"] = None
        if self.model_type == "gpt_oss":
            return gpt_oss.config_to_hf(self, cfg)
        if self.model_type == "deepseek_v3":
            return deepseek.config_to_hf(self, cfg)
        if self.linear is not None:
            return qwen3_5.config_to_hf(self, cfg)
        if self.is_moe:
            cfg.update(self._moe_to_hf())
        if self.is_vlm:
            return self._vlm_to_hf(cfg)
        return cfg

    def _vlm_to_hf(self, text: dict[str, Any]) -> dict[str, Any]:
        """The nested layout transformers 5 writes: ``text_config``, ``vision_config``,
        token ids."""
        arch = text.pop("architectures")
        text.update(
            model_type="qwen2_5_vl_text",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": text.pop("rope_theta"),
                "mrope_section": list(self.mrope_section),
            },
        )
        text.pop("rope_scaling")
        return {
            "architectures": arch,
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": self.vision.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            **self.vision.token_ids(),
        }

    def _moe_to_hf(self) -> dict[str, Any]:
        if self.model_type == "qwen3_moe" and (
            self.shared_expert_intermediate_size
            or self.moe_score_func != "softmax"
            or self.moe_route_scale != 1.0
        ):
            raise ValueError(
                "qwen3_moe with a shared expert, sigmoid scores or moe_route_scale "
                "!= 1 has no Hugging Face layout to export to"
            )
        cfg: dict[str, Any] = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "router_z_loss_coef": self.router_z_loss_coef,  # Tandem's; transformers keeps it unread
            "output_router_logits": False,
        }
        if self.model_type == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            cfg["qkv_bias"] = True
        return cfg

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ sizes
    def num_params(self, include_embedding: bool = True) -> int:
        """Number of distinct parameters (a tied output matrix counts once)."""
        d, h = self.hidden_size, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        per_layer = self._attention_matmul_params() + 2 * d  # + two norms
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * h
        if self.has_biases:  # GPT-OSS: o bias and sinks
            per_layer += d + self.num_heads
        if self.is_mla:  # the q and kv latents' norms
            per_layer += deepseek.mla_num_params(self) - deepseek.mla_num_params(self, False)
        ffn = sum(self._ffn_matmul_params(i, active=False) for i in range(self.num_layers))
        total = self.num_layers * per_layer + ffn + d  # + final norm
        if self.linear is not None:  # DeltaNet layers in place of (gated) attention ones
            total += sum(
                qwen3_5.linear_num_params(self) - per_layer + 2 * d
                if self.is_linear_layer(i)
                else qwen3_5.attention_matmul_params(self, i) - self._attention_matmul_params()
                for i in range(self.num_layers)
            )
        if self.vision is not None:
            total += self.vision.num_params()
        if not self.tie_word_embeddings:
            total += self.vocab_size * d
        if include_embedding:
            total += self.vocab_size * d
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token: ``6 * N_matmul + 12 * L * Hq * D * S``.

        ``N_matmul`` counts every weight used in a matmul, including the output
        projection even when tied (the embedding lookup itself is free); in MoE
        layers only the router, shared expert and ``num_experts_per_tok`` experts
        (the weights one token meets). The attention term follows the PaLM
        convention and ignores the causal mask.
        """
        ffn = sum(self._ffn_matmul_params(i, active=True) for i in range(self.num_layers))
        mixers = self.num_layers * self._attention_matmul_params()
        if self.linear is not None:
            mixers = sum(qwen3_5.attention_matmul_params(self, i) for i in range(self.num_layers))
        matmul = mixers + ffn + self.vocab_size * self.hidden_size
        attn = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6 * matmul + attn

    def _attention_matmul_params(self) -> int:
        if self.is_mla:
            return deepseek.mla_num_params(self, norms=False)
        d, h = self.hidden_size, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        return d * q + 2 * d * kv + q * d

    def _ffn_matmul_params(self, layer_id: int, active: bool) -> int:
        d = self.hidden_size
        if not self.is_moe_layer(layer_id):
            return 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * d * self.shared_expert_intermediate_size + (
            d if self.shared_expert_gated else 0
        )
        biases = (
            0
            if active or not self.has_biases
            else self.num_experts * (1 + 2 * self.moe_intermediate_size + d)
        )  # GPT-OSS: router and expert biases (no matmul: in the total only)
        return experts * 3 * d * self.moe_intermediate_size + d * self.num_experts + shared + biases


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    """The RoPE variant named by an HF ``rope_scaling`` dict; ValueError when unsupported."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} (rope_scaling={rope_scaling}); "
            f"supported: {SUPPORTED_ROPE_TYPES}"
        )
    if kind == "yarn":
        missing = [
            k for k in ("factor", "original_max_position_embeddings") if k not in rope_scaling
        ]
        if missing:
            raise ValueError(f"yarn rope_scaling is missing {missing}: {rope_scaling}")
    if kind == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rope_scaling]
        if missing:
            raise ValueError(f"llama3 rope_scaling is missing {missing}: {rope_scaling}")
    return kind


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the 4.x keys or the 5.x ``rope_parameters`` dict."""
    params = config.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    if scaling.get("rope_type") == "llama3":
        scaling.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 8192)
        )
    return float(theta), scaling


def _hf_mrope(config: dict[str, Any]) -> list[int]:
    """M-RoPE sections from ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x); [] when absent."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (config.get(key) or {}).get("mrope_section")
        if section:
            return [int(x) for x in section]
    return []
