"""Named tiny model sizes for from-scratch CPU runs and tests.

Vocab sizes are 512 so `tandem.models.tokenizer.build_char_tokenizer` (a few hundred
ids) fits every flavor.
"""

from __future__ import annotations

import copy

from tandem.models.args import ModelArgs
from tandem.models.image_processor import ImageProcessor
from tandem.models.qwen3_5 import LinearArgs
from tandem.models.vision import VisionArgs

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_DEBUG_QWEN3 = ModelArgs(
    model_type="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=1e6,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
# debug-qwen3 with 8 experts of width 32, 2 per token, in every layer.
_DEBUG_MOE = _DEBUG_QWEN3.replace(
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)

# The special ids of tandem.models.vl_template.build_vl_char_tokenizer ("builtin:vl-char"):
# <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|> follow the character ids.
_VL_CHAR_IDS = dict(
    vision_start_token_id=360, vision_end_token_id=361, image_token_id=362, video_token_id=363
)
# A Qwen2.5-VL of debug-qwen3's LM size (Qwen2 attention, M-RoPE) and a 2-block tower whose one
# window covers a 56 x 56 image; images are resized to 56 x 56 (2 x 2 LM rows).
_DEBUG_VL = ModelArgs(
    model_type="qwen2_5_vl",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=1e6,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    mrope_section=[2, 3, 3],
    vision=VisionArgs(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        window_size=56,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
        processor=ImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
        **_VL_CHAR_IDS,
    ),
)

# GPT-OSS at debug-qwen3-moe's size: every other layer a 16-token sliding window, sinks,
# biases, the clamped SwiGLU, YaRN RoPE (tandem/models/gpt_oss.py).
_DEBUG_GPT_OSS = ModelArgs(
    model_type="gpt_oss",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 512,
    },
    max_position_embeddings=2048,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_score_func="softmax_topk",
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    attention_sinks=True,
    swiglu_limit=7.0,
)
# gpt-oss-20b / -120b: their config.json (GptOssForCausalLM: hidden 2880, 64 q / 8 kv heads of
# 64, experts of 2880, 4 per token, a 128-token window in every even layer, vocab 201088,
# untied, rope_theta 150000 with YaRN factor 32 over 4096 positions, 131072 positions,
# rms_norm_eps 1e-5); 20b: 24 layers of 32 experts, 120b: 36 layers of 128.
_GPT_OSS_20B = _DEBUG_GPT_OSS.replace(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    max_position_embeddings=131072,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    eos_token_id=[200002, 199999, 200012],
)

# Qwen3.5 at debug-qwen3's size: three gated DeltaNet layers (2 key / 4 value heads of 16, a
# 4-tap convolution) then one gated full-attention layer (RoPE on a quarter of each head).
_DEBUG_QWEN35 = ModelArgs(
    model_type="qwen3_5_text",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=1e7,
    max_position_embeddings=2048,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    partial_rotary_factor=0.25,
    linear=LinearArgs(
        conv_kernel=4, key_head_dim=16, value_head_dim=16, num_key_heads=2, num_value_heads=4
    ),
)

# Qwen3.5-MoE at debug-qwen3.5's size: 8 experts of width 32 (2 per token) and a gated shared
# expert of 64 in every layer.
_DEBUG_QWEN35_MOE = _DEBUG_QWEN35.replace(
    model_type="qwen3_5_moe_text",
    intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    shared_expert_intermediate_size=64,
)

# DeepSeek-V3 at debug size: MLA (q rank 24, kv rank 16, 8 rotary of 24 key dims, values of
# 16), one dense layer then MoE (8 experts in 4 groups, 2 groups and 2 experts per token, a
# shared expert), YaRN with DeepSeek's mscale.
_DEBUG_DSV3 = ModelArgs(
    model_type="deepseek_v3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=24,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 512,
    },
    max_position_embeddings=2048,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_interleave=True,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    shared_expert_intermediate_size=32,
    mlp_only_layers=[0],
    moe_score_func="sigmoid",
    moe_route_scale=2.5,
    moe_n_group=4,
    moe_topk_group=2,
    router_aux_loss_coef=0.0,
)

FLAVORS: dict[str, ModelArgs] = {
    "debug-qwen3": _DEBUG_QWEN3,
    # debug-qwen3's size in the Llama-3 layout (another family's tiny teacher)
    "debug-llama3": ModelArgs(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    "tiny-qwen3": ModelArgs(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "tiny-qwen2": ModelArgs(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1e6,
        max_position_embeddings=4096,
    ),
    "tiny-llama3": ModelArgs(
        model_type="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=4096,
    ),
    # Mixture of experts. debug-qwen3-moe: 8 experts, 2 per token, for tests; tiny-qwen3-moe:
    # the quickstart size (about tiny-qwen3's active compute per token). debug-dsv3-moe:
    # DeepSeek-V3 routing (sigmoid scores, selection bias, route scale, an ungated shared
    # expert) on Qwen3-MoE attention; it has no HF layout, so it cannot be exported.
    "debug-qwen3-moe": _DEBUG_MOE,
    "debug-dsv3-moe": _DEBUG_MOE.replace(
        shared_expert_intermediate_size=32,
        moe_score_func="sigmoid",
        moe_route_scale=2.5,
        mlp_only_layers=[0],
    ),
    "tiny-qwen3-moe": _DEBUG_MOE.replace(
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        max_position_embeddings=4096,
        moe_intermediate_size=192,
    ),
    # Vision-language: debug-qwen2_5_vl for tests (tandem/models/vlm.py, "builtin:vl-char"
    # tokenizer).
    "debug-qwen2_5_vl": _DEBUG_VL,
    "tiny-qwen2_5_vl": _DEBUG_VL.replace(
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        mrope_section=[4, 6, 6],
        vision=VisionArgs(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            window_size=56,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            processor=ImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
            **_VL_CHAR_IDS,
        ),
    ),
    "debug-gpt-oss": _DEBUG_GPT_OSS,
    "debug-deepseek-v3": _DEBUG_DSV3,
    "debug-qwen3.5": _DEBUG_QWEN35,
    "debug-qwen3.5-moe": _DEBUG_QWEN35_MOE,
    # Published sizes, for planning (train.py --plan) before a download; from-scratch training at
    # these sizes is possible but not what they are for. Qwen3-8B: the Qwen3-8B model card (36
    # layers, 32 q / 8 kv heads) and a Qwen3ForCausalLM config.json of that size (hidden 4096,
    # intermediate 12288, head_dim 128, vocab 151936, untied, rope_theta 1e6, 40960 positions).
    "qwen3-8b": ModelArgs(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    # Qwen3-32B: its config.json (hidden 5120, intermediate 25600, 64 layers, 64 q / 8 kv heads,
    # head_dim 128, vocab 151936, untied), as summarised in the model card and third-party copies.
    "qwen3-32b": ModelArgs(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    # Meta-Llama-3-70B: its config.json (hidden 8192, intermediate 28672, 80 layers, 64 q / 8 kv
    # heads, vocab 128256, untied, rope_theta 5e5, 8192 positions, rms_norm_eps 1e-5).
    "llama3-70b": ModelArgs(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    # Qwen3-30B-A3B: its config.json (Qwen3MoeForCausalLM: 48 layers, hidden 2048, 32 q / 4 kv
    # heads, head_dim 128, 128 experts of moe_intermediate_size 768, 8 per token, norm_topk_prob,
    # every layer MoE (intermediate_size 6144 unused), vocab 151936, untied, rope_theta 1e6, 40960
    # positions).
    "qwen3-30b-a3b": ModelArgs(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Qwen2.5-VL-7B: its module tree as printed by transformers (28 layers of hidden 3584, q 3584 /
    # kv 512 (4 heads of 128), MLP 18944, vocab 152064, untied; a 32-block tower of width 1280,
    # 16 heads, MLP 3420, merger 5120 -> 3584) and the family's config.json values (rope_theta 1e6,
    # M-RoPE 16/24/24, 128000 positions, window 112 px, full attention in blocks 7/15/23/31,
    # the vision token ids 151652/151653/151655/151656, processor pixels 56*56 .. 28*28*1280).
    "qwen2.5-vl-7b": ModelArgs(
        model_type="qwen2_5_vl",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=128000,
        mrope_section=[16, 24, 24],
        eos_token_id=[151645],
        vision=VisionArgs(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            window_size=112,
            out_hidden_size=3584,
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
            vision_start_token_id=151652,
            vision_end_token_id=151653,
            image_token_id=151655,
            video_token_id=151656,
        ),
    ),
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": _GPT_OSS_20B.replace(
        num_layers=36,
        num_experts=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
    ),
    # DeepSeek-V3 (671B): its config.json (61 layers of hidden 7168, 128 heads, q rank 1536, kv
    # rank 512, 128 + 64 key dims, values of 128, the first 3 layers dense of 18432, then 256
    # experts of 2048 in 8 groups, 4 groups and 8 experts per token, one shared expert, routed
    # scale 2.5, vocab 129280, untied, rope_theta 10000 with YaRN factor 40 over 4096 positions,
    # mscale 1 / 1, 163840 positions); its multi-token-prediction layer is not counted.
    "deepseek-v3": _DEBUG_DSV3.replace(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        shared_expert_intermediate_size=2048,
        mlp_only_layers=[0, 1, 2],
        moe_n_group=8,
        moe_topk_group=4,
        bos_token_id=0,
        eos_token_id=[1],
    ),
    # Qwen3.5-9B's text model as transformers' Qwen3_5TextConfig defaults describe it ("the
    # Qwen3.5-9B style configuration"): 32 layers of hidden 4096 (every fourth full attention,
    # 16 q / 4 kv heads of 256, RoPE on a quarter), DeltaNet 16 key / 32 value heads of 128,
    # intermediate 12288, vocab 248320, untied (rope_theta, which no plan reads, as debug's).
    "qwen3.5-9b": _DEBUG_QWEN35.replace(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=32,
        num_heads=16,
        num_kv_heads=4,
        head_dim=256,
        max_position_embeddings=262144,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        linear=LinearArgs(),
    ),
    # Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults describe it
    # ("the Qwen3.5-35B-A3B style configuration"): 40 layers of hidden 2048 (every fourth full
    # attention, 16 q / 2 kv heads of 256), DeltaNet 16 key / 32 value heads of 128, 256 experts
    # of 512 (8 per token) and a gated shared expert of 512 in every layer, vocab 248320.
    "qwen3.5-35b-a3b": _DEBUG_QWEN35_MOE.replace(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_layers=40,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        max_position_embeddings=262144,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
        linear=LinearArgs(),
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
}


def get_flavor(name: str) -> ModelArgs:
    """A fresh copy of the named flavor (callers may mutate it)."""
    if name not in FLAVORS:
        raise KeyError(f"unknown model flavor {name!r}; available: {sorted(FLAVORS)}")
    args = FLAVORS[name]
    return args.replace(
        rope_scaling=dict(args.rope_scaling) if args.rope_scaling else None,
        mlp_only_layers=list(args.mlp_only_layers),
        mrope_section=list(args.mrope_section),
        layer_types=list(args.layer_types),
        vision=copy.deepcopy(args.vision),
    )
