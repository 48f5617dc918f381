"""The memory planner's mixture-of-experts terms (tandem/rl/plan/planner.py uses them).

An MoE layer runs its feed-forward on ``T * k`` routed rows instead of ``T`` tokens; with
expert parallelism a rank holds ``E / ep`` whole experts outside FSDP2 and the rows travel
to them. `ffn_saved_per_token` counts what such a layer saves for backward (router scores
and logits, indices, the rows and the experts' intermediates, a shared expert), under each
activation-checkpointing mode and EP; `dispatch_transient` one layer's rows in flight. Each
term and why: docs/scaling.md.
"""

from __future__ import annotations

from tandem.models.args import ModelArgs


def is_expert(name: str) -> bool:
    """A stacked expert weight (``layers.N.moe.experts.w1/w2/w3``), which EP shards."""
    return ".moe.experts." in name


def moe_layer_count(args: ModelArgs, layers: list[int] | range) -> int:
    return sum(1 for i in layers if args.is_moe_layer(i))


def ffn_saved_per_token(args: ModelArgs, c: int, ac: str, tp: int = 1, ep: int = 1) -> float:
    """Bytes one MoE layer's feed-forward saves for backward per token (see the module
    docstring)."""
    e, k, d, i = (
        args.num_experts,
        args.num_experts_per_tok,
        args.hidden_size,
        args.moe_intermediate_size,
    )
    if ac == "full":
        return 8 * k  # routing ids the block keeps (the block input is the dense formula's)
    if ac == "selective":
        # matmul outputs only: the router's logits; the grouped GEMMs are recomputed
        return c * e
    router = 8 * e + 4 + 12 * k + (4 * k + 4 if args.norm_topk_prob else 0)
    row = 8 + c * d + 4 * c * i + 8 + 4 * d + (8 if ep > 1 else 0)
    shared = args.shared_expert_intermediate_size / tp
    extra = 4 * c * shared + (c * d + 2 * c if shared and args.shared_expert_gated else 0)
    return router + k * row + extra


def ep_cast_bytes(args: ModelArgs, c: int, ep: int) -> int:
    """Per MoE layer: the local experts cast to the compute dtype, which the grouped GEMMs save."""
    if ep == 1 or c == 4:
        return 0
    return 3 * (args.num_experts // ep) * args.moe_intermediate_size * args.hidden_size * c


def dispatch_transient(args: ModelArgs, tokens: int, c: int, ep: int) -> float:
    """One MoE layer's routed rows in flight beyond what is saved, ``T k D`` each: without EP the
    experts' output (``c``) and the fp32 weighted product before the sum over ``k``; under EP at
    the return all-to-all the rows sent and received, the outputs before and after their
    reordering and the rows coming back (``5 c``), which outlasts the product."""
    rows = tokens * args.num_experts_per_tok * args.hidden_size
    return rows * (5 * c if ep > 1 else c + 4)
