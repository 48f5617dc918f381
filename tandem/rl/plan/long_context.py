"""The memory planner's long-context terms: context parallelism and the rollout's KV room.

Context parallelism (tandem/parallel/cp.py, ``parallel.cp``): the packer gives a sequence
longer than ``rl.micro_batch_tokens`` a micro-batch of its own and a cp rank holds
``1 / cp`` of each packed row, so one rank's activations are those of
``max(micro_batch_tokens, ceil(seq_len / cp))`` tokens (`tokens_per_rank`): the longest
sequence, ``data.max_length`` (prompt + ``rollout.max_tokens``), split cp ways. The log-prob
head works on the same local tokens (the fused chunked head never holds ``[S, V]`` logits;
its chunk is a transient already counted). What cp adds (`cp_transient`): Ulysses sends
and receives one layer's q, k and v (its all-to-all buffers, with K/V repeated when cp
exceeds the KV heads); the ring holds a tile's fp32 probabilities and, in the backward, their
gradient (`tandem.parallel.ring_attention`'s ``TILE_Q x TILE_K`` per query head) and K/V passing
around with their fp32 gradient accumulators. FSDP2 shards over ``dp_shard x cp``.

KV room (`kv_choices`): during the rollout a rank keeps its training state (parameters,
and unless ``rl.offload_optimizer`` the AdamW moments and gradients; with
``parallel.cpu_offload`` FSDP2 keeps parameters on the host), the generation shard and
the reshard buffers; what is left of `USABLE` of the device could hold the KV of that
many full-length sequences (``data.max_length`` tokens each). Printed for the configured
choice and for offloading the optimizer state, then the parameters too, so a long-context
run can see what each buys in sequences against what it costs (the state's trip to the
host and back each step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tandem.models.args import ModelArgs
from tandem.parallel.generation_layout import GenerationLayout, local_args
from tandem.parallel.ring_attention import TILE_K, TILE_Q
from tandem.rl.generator.kv_cache import KVCache


def tokens_per_rank(micro_batch_tokens: int, seq_len: int, cp: int) -> int:
    """Tokens one rank holds in its largest micro-batch (see the module docstring)."""
    return max(micro_batch_tokens, -(-seq_len // cp))


def cp_transient(args: ModelArgs, tokens: int, elem: int, cp: int, style: str) -> float:
    """Bytes in flight for cp's attention in one layer (0 at cp = 1)."""
    if cp == 1:
        return 0.0
    hd = args.head_dim
    if style == "ring":
        scores = (
            2 * args.num_heads * min(TILE_Q, tokens) * min(TILE_K, tokens) * 4
        )  # P and dP (dS in place)
        kv = (
            2 * 2 * tokens * args.num_kv_heads * hd * (elem + 4)
        )  # K/V held and arriving, + fp32 grads
        return scores + kv
    kv_heads = args.num_kv_heads
    if kv_heads % cp:  # repeated until cp divides them (tandem/parallel/cp.py kv_repeats)
        kv_heads = args.num_kv_heads * (cp // math.gcd(args.num_kv_heads, cp))
    return 2 * tokens * (args.num_heads + 2 * kv_heads) * hd * elem  # send + receive buffers


@dataclass(frozen=True)
class KVChoice:
    """One way to spend the rollout's memory: what stays resident, the KV room left, sequences."""

    name: str
    resident: float
    room: float
    sequences: int


def kv_choices(
    usable: float,
    params: float,
    critic: float,
    reference: float,
    fixed: float,
    seq_bytes: float,
    offload_optimizer: bool,
    cpu_offload: bool,
) -> list[KVChoice]:
    """The configured choice, then ``rl.offload_optimizer`` and ``parallel.cpu_offload`` in turn.

    ``params``: the rank's fp32 parameter shard bytes; ``critic``: the critic's (0 without one;
    its state is offloaded with the policy's); ``reference``: a frozen copy's; ``fixed``: the
    generation shard and reshard buffers; ``seq_bytes``: one full-length sequence's KV."""

    def choice(name: str, opt_off: bool, param_off: bool) -> KVChoice:
        on_device = 0.0 if param_off else params + critic
        resident = on_device * (1 if opt_off else 3) + (0.0 if param_off else reference)
        room = max(usable - resident - fixed, 0.0)
        return KVChoice(name, resident, room, int(room // seq_bytes) if seq_bytes else 0)

    out = [choice("as configured", offload_optimizer, cpu_offload)]
    if not offload_optimizer:
        out.append(choice("rl.offload_optimizer = true", True, cpu_offload))
    if not cpu_offload:
        out.append(choice("+ parallel.cpu_offload = true", True, True))
    return out


def format_kv_room(choices: list[KVChoice], max_tokens: int, seq_len: int) -> str:
    """The rollout's KV room per choice, one line each (``train.py --plan``)."""
    head = f"full-length sequences of {seq_len} tokens, rollout.max_tokens = {max_tokens}"
    lines = [f"rollout KV room ({head}):"]
    for c in choices:
        lines.append(
            f"  {c.name:<32}resident {c.resident / 1e9:6.2f} GB, room {c.room / 1e9:6.2f} GB, "
            f"{c.sequences} sequences"
        )
    return "\n".join(lines)


def cp_degrees(world: int, devices_per_node: int, num_heads: int, style: str) -> list[int]:
    """The planner's cp candidates (FSDP2 x cp; cp composes with FSDP2 alone so far): powers of
    two within a node that divide ``world``, and the query heads under Ulysses."""
    out, cp = [], 2
    while cp <= min(world, devices_per_node):
        if world % cp == 0 and (style == "ring" or num_heads % cp == 0):
            out.append(cp)
        cp *= 2
    return out


def kv_room(planner: Any, layout: Any, usable: float, kinds: list) -> list[KVChoice]:
    """`kv_choices` for ``layout``'s busiest rank (``kinds``: planner.rank_kinds of it): the
    rollout's KV room as configured, then with the optimizer state and the parameters offloaded."""
    s = planner.s
    gen = GenerationLayout(tp=layout.rollout_tp, vocab_parallel=s.vocab_parallel)
    per_block = KVCache.bytes_per_block(local_args(planner.args, gen), s.block_size, s.gen_dtype)
    seq = per_block * -(-s.max_len // s.block_size)
    shard = planner.generation_shard(layout.rollout_tp)
    fixed = shard + min(s.bucket_bytes, shard)
    worst = None
    for _, stages in kinds:
        params = planner.param_bytes(layout, stages)
        critic = planner.param_bytes(layout, stages, skip="output") if s.critic else 0
        reference = params if s.reference else 0
        rows = kv_choices(
            usable, params, critic, reference, fixed, seq, s.offload_optimizer, s.cpu_offload
        )
        if worst is None or rows[0].room < worst[0].room:
            worst = rows
    return worst
