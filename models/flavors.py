"""Named tiny model sizes for from-scratch CPU runs and tests.

Vocab sizes are 512 so `models.tokenizer.build_char_tokenizer` (a few hundred
ids) fits every flavor.
"""

from __future__ import annotations

from models.args import ModelArgs

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
    model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)

FLAVORS: dict[str, ModelArgs] = {
    "debug-qwen3": _DEBUG_QWEN3,
    "debug-llama3": ModelArgs(  # debug-qwen3's size in the Llama-3 layout (another family's tiny teacher)
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
}


def get_flavor(name: str) -> ModelArgs:
    """A fresh copy of the named flavor (callers may mutate it)."""
    if name not in FLAVORS:
        raise KeyError(f"unknown model flavor {name!r}; available: {sorted(FLAVORS)}")
    args = FLAVORS[name]
    return args.replace(
        rope_scaling=dict(args.rope_scaling) if args.rope_scaling else None,
        mlp_only_layers=list(args.mlp_only_layers),
    )
