"""The memory planner: ``train.py --config X --plan``, per-rank bytes of each phase, before
any launch.

Nothing is allocated: shapes come from a meta-device `Transformer`, each rank's share from the
trainer's own rules (tandem/parallel/tp.py, generation_layout.py, FSDP2's dim-0 chunks, pp.py),
the KV pool from the generator's sizing rule, activations from a closed-form count of what the
model saves for backward (checked against a CPU run in tests/plan/test_plan.py).

Two phases share each device (DESIGN.md): the *update* (parameters, gradients, AdamW's moments,
FSDP2's unsharded transient, activations) and the *rollout* (the resident training state, the
generation shard, the reshard buffers, the KV pool); with LoRA the adapters alone train and the
kept generation copy counts in the update too (docs/lora.md). A layout fits when the larger phase
of its busiest rank is at most `USABLE` of the device (generation_layout.py `HEADROOM`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, apply_lora, is_adapter
from tandem.parallel.generation_layout import (
    HEADROOM,
    GenerationLayout,
    auto_tp,
    check_divisible,
    local_args,
    needed_box,
    shard_bytes,
)
from tandem.parallel.pp import SCHEDULES, pipeline_split, stage_ids_for_rank
from tandem.rl.generator.kv_cache import KVCache
from tandem.rl.plan import long_context as lc
from tandem.rl.plan.layout import Layout, Settings
from tandem.rl.plan.moe import (
    dispatch_transient,
    ep_cast_bytes,
    ffn_saved_per_token,
    is_expert,
    moe_layer_count,
)
from tandem.rl.rollout.sampling import resident_bytes

GB = 1e9
USABLE = HEADROOM  # share of a device a plan may fill
DEFAULT_DEVICE_GB = 80.0
LINEAR_NODES = 16  # `Planner.smallest` tries each whole-node count up to this, then doubles


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def param_shapes(
    args: ModelArgs, lora: LoraSpec | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model, a tied head listed once
    (adapters too)."""
    from tandem.models.vlm import make_model

    with torch.device("meta"):
        model = make_model(args)  # a vision-language model's tower included
        if lora is not None:
            apply_lora(model, lora)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _held_names(
    shapes: list[tuple[str, tuple[int, ...]]],
    args: ModelArgs,
    stages: list[list[int]] | None,
) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters one rank holds: all of them, or those of its pipeline ``stages`` (layer
    lists; the first stage owns the embedding, the last the final norm and the head, a tied
    head then being a separate copy of the embedding)."""
    if stages is None:
        return shapes
    n_layers = args.num_layers
    mine = {i for s in stages for i in s}
    first, last = 0 in mine, n_layers - 1 in mine
    out = [
        (n, s)
        for n, s in shapes
        if (
            _layer(n) in mine
            if _layer(n) is not None
            else (first if n.startswith("tok_embeddings") else last)
        )
    ]
    if last and args.tie_word_embeddings:
        out.append(("output.weight", dict(shapes)["tok_embeddings.weight"]))
    return out


def _local_numel(name: str, shape: tuple[int, ...], tp: int, fsdp: int) -> int:
    """Elements of rank 0's share of a parameter: TP as tandem/parallel/tp.py splits it (column /
    row / vocabulary), then FSDP2's dim-0 chunk (the first rank's chunk is the largest)."""
    _, local = (
        needed_box(name, shape, GenerationLayout(tp=tp, vocab_parallel=True))
        if tp > 1
        else (None, shape)
    )
    rows = -(-local[0] // fsdp)
    n = rows
    for s in local[1:]:
        n *= s
    return n


@dataclass
class RankPlan:
    """Bytes of one kind of rank in each phase (``update`` / ``rollout``: component -> bytes)."""

    kind: str
    update: dict[str, float]
    rollout: dict[str, float]
    kv_sequences: int = 0
    freed: tuple[float, int] = (0.0, 0)  # rollout.weight_dtype: bytes it frees, sequences they hold

    @property
    def peak(self) -> float:
        return max(sum(self.update.values()), sum(self.rollout.values()))

    def peak_phase(self) -> str:
        return "update" if sum(self.update.values()) >= sum(self.rollout.values()) else "rollout"


def rank_kinds(
    args: ModelArgs, layout: Layout, schedule: str
) -> list[tuple[str, list[list[int]] | None]]:
    """The distinct kinds of rank: one without pipelining; else the first stage, a middle
    one, the last."""
    if layout.pp == 1:
        return [("every rank", None)]
    per = SCHEDULES[schedule][1]
    split = pipeline_split(args, layout.pp, stages_per_rank=per)
    kinds = (
        [("first stage", 0)]
        + ([("middle stage", layout.pp // 2)] if layout.pp > 2 else [])
        + [("last stage", layout.pp - 1)]
    )
    return [(name, [split[s] for s in stage_ids_for_rank(r, layout.pp, per)]) for name, r in kinds]


def activation_bytes(
    args: ModelArgs,
    tokens: int,
    layers: int,
    dtype: torch.dtype,
    ac: str,
    tp: int = 1,
    *,
    first: bool = True,
    last: bool = True,
    vocab_parallel_head: bool | None = None,
    moe_layers: int | None = None,
    ep: int = 1,
) -> float:
    """Bytes saved for backward by one micro-batch of ``tokens`` through ``layers`` blocks.

    Per block and token, what autograd keeps (counted from the ops in tandem/models/transformer.py;
    the rope tables once): each RMSNorm its input and normalised output (and, below fp32,
    the fp32 copy it normalises) plus a row statistic; each projection its input, a
    sequence-parallel TP rank the all-gathered whole; q/k-norm (Qwen3) the q and k heads;
    attention q, k, v, its output and log-sum-exp, and the packed segments' output gather;
    SwiGLU gate, up, silu and product. ``full`` checkpointing keeps a block's input;
    ``selective`` (tandem/parallel/ac.py) its matmul and attention outputs and TP collectives.
    The head: ids, the final norm, and either the completion hidden states of the chunked
    log-prob path or (TP, vocab-parallel) the logits shard and its fp32 log-softmax.
    ``moe_layers`` of the ``layers`` (default: those among the first ``layers``) have an MoE
    feed-forward instead of SwiGLU, counted by tandem/rl/plan/moe.py (``ep``: its degree)."""
    c, d, hd = _elem(dtype), args.hidden_size, args.head_dim
    q, k, i = args.num_heads * hd / tp, args.num_kv_heads * hd / tp, args.intermediate_size / tp
    hq, hk = args.num_heads / tp, args.num_kv_heads / tp
    sp = tp  # sequence parallel: norms and the residual stream on tokens / tp

    def norm(n: float, rows: float = 1) -> float:  # per token
        return (8 * n if c == 4 else 6 * n) + 4 * rows

    if ac == "full":
        per_layer, ffn = c * d / sp, 0.0
    elif ac == "selective":  # the feed-forward's part: gate / up and down outputs
        per_layer, ffn = c * d / sp + c * (q + 2 * k) + c * q + 4 * hq + c * d, c * 2 * i + c * d
        if tp > 1:
            per_layer += 2 * c * d / tp  # the reduce-scatter outputs, kept too
    else:
        per_layer, ffn = (
            2 * (norm(d) / sp + c * d) + c * (q + 2 * k) + 2 * c * q + 4 * hq,
            4 * c * i,
        )
        if args.qk_norm:
            per_layer += norm(q, hq) + norm(k, hk)
    n_moe = moe_layer_count(args, range(layers)) if moe_layers is None else moe_layers
    moe = ffn_saved_per_token(args, c, ac, tp, ep) if n_moe else 0.0
    # + rope cos / sin
    total = layers * per_layer + (layers - n_moe) * ffn + n_moe * moe + 2 * c * hd
    if first:
        total += 8  # token ids (embedding)
    if last:
        if vocab_parallel_head if vocab_parallel_head is not None else tp > 1:
            v = -(-args.vocab_size // tp)
            # gathered hidden, logits shard, fp32 log-softmax
            total += norm(d) / sp + c * d + (c + 4) * v
        else:
            # completion hidden states (all tokens, at most), index, targets, stats
            total += norm(d) / sp + c * d + 24
    return tokens * total + (n_moe * ep_cast_bytes(args, c, ep) if ac == "none" else 0)


class Planner:
    """Per-rank plans of one model and config settings for any layout (sizes cached)."""

    def __init__(self, args: ModelArgs, settings: Settings) -> None:
        self.args, self.s = args, settings
        self.shapes = param_shapes(args, settings.lora)
        self._shards: dict[tuple[int, bool], int] = {}

    # ---- pieces ----------------------------------------------------------------------

    def fsdp_applied(self, layout: Layout) -> bool:
        """tandem/parallel/parallelize.py's rule on a GPU target (FSDP2 over dp_shard x cp)."""
        dp = layout.dp_replicate * layout.dp_shard * layout.cp
        return dp > 1 or self.s.compute_dtype != torch.float32 or self.s.cpu_offload

    def param_bytes(
        self,
        layout: Layout,
        stages: list[list[int]] | None,
        *,
        skip: str = "",
        trained: bool = False,
    ) -> int:
        """fp32 bytes of this rank's parameter shards (the master copy FSDP2 keeps); under EP the
        experts are this rank's ``E / ep`` of them (a DTensor Shard(0), outside FSDP2).
        ``trained``: those with gradients and AdamW moments (with LoRA, the adapters)."""
        fsdp = layout.dp_shard * layout.cp if self.fsdp_applied(layout) else 1
        held = _held_names(self.shapes, self.args, stages)
        return 4 * sum(
            _local_numel(n, s, layout.tp, layout.ep if layout.ep > 1 and is_expert(n) else fsdp)
            for n, s in held
            if not (skip and n.startswith(skip))
            and not (trained and self.s.lora is not None and not is_adapter(n))
        )

    def unsharded_transient(self, layout: Layout, stages: list[list[int]] | None) -> int:
        """FSDP2's gathered copies while computing: the root's (embedding, head) for the whole
        forward, two blocks (the one computing and the one prefetched) and one block's
        unsharded gradients before their reduce-scatter. Under EP the experts are not FSDP2's
        (the tokens travel to them: `plan_moe.dispatch_transient`); with ep = 1 they
        are gathered."""
        if not self.fsdp_applied(layout):
            return 0
        c, red = _elem(self.s.compute_dtype), _elem(self.s.reduce_dtype)
        held = [
            (n, s)
            for n, s in _held_names(self.shapes, self.args, stages)
            if not (layout.ep > 1 and is_expert(n))
        ]
        root = sum(_local_numel(n, s, layout.tp, 1) for n, s in held if _layer(n) is None)
        blocks: dict[int, int] = {}
        grads: dict[int, int] = {}  # the unsharded gradients of a block: its trained parameters'
        for n, s in held:
            if _layer(n) is not None:
                blocks[_layer(n)] = blocks.get(_layer(n), 0) + _local_numel(n, s, layout.tp, 1)
                if self.s.lora is None or is_adapter(n):
                    grads[_layer(n)] = grads.get(_layer(n), 0) + _local_numel(n, s, layout.tp, 1)
        block = max(blocks.values(), default=0)
        return c * (root + 2 * block) + red * max(grads.values(), default=0)

    def generation_shard(self, g: int, quantized: bool = True) -> int:
        """One rank's generation shard; ``quantized=False``: as if rollout.weight_dtype = bf16."""
        fmt = self.s.weight_format if quantized else None
        key = (g, self.s.vocab_parallel, fmt)
        if key not in self._shards:
            self._shards[key] = shard_bytes(
                self.args,
                GenerationLayout(tp=g, vocab_parallel=self.s.vocab_parallel),
                self.s.gen_dtype,
                self.s.lora,
                fmt,
            )
        return self._shards[key]

    def kv_pool(self, layout: Layout) -> tuple[int, int]:
        """(bytes, full-length sequences) of one generator's KV pool on one rank, by the
        generator's rule: as many blocks as rollout.kv_cache_gb holds, at most what the
        rollout's sequences of max_model_len tokens need at once."""
        s = self.s
        local = local_args(
            self.args, GenerationLayout(tp=layout.rollout_tp, vocab_parallel=s.vocab_parallel)
        )
        per_block = KVCache.bytes_per_block(local, s.block_size, s.gen_dtype, s.kv_quant)
        blocks_per_seq = -(-s.max_len // s.block_size)
        # a generation group pools its ranks' prompts
        prompts = -(-s.prompts_per_step // layout.world) * layout.rollout_tp
        seqs = min(s.max_num_seqs, max(1, prompts * s.num_samples))
        blocks = min(int(s.kv_cache_gb * GB) // per_block, seqs * blocks_per_seq)
        return blocks * per_block, blocks // blocks_per_seq

    def freed_by_weight_dtype(self, layout: Layout) -> tuple[float, int]:
        """What rollout.weight_dtype frees on a rank's generation shard, in bytes and in
        full-length sequences of KV that room would hold (rollout.kv_cache_gb may take it)."""
        if self.s.recipe != "rl" or self.s.weight_format is None:
            return 0.0, 0
        g = layout.rollout_tp
        freed = self.generation_shard(g, False) - self.generation_shard(g)
        local = local_args(self.args, GenerationLayout(tp=g, vocab_parallel=self.s.vocab_parallel))
        per_seq = KVCache.bytes_per_block(
            local, self.s.block_size, self.s.gen_dtype, self.s.kv_quant
        ) * -(-self.s.max_len // self.s.block_size)
        return float(freed), int(freed // per_seq)

    def micro_batch(self, layout: Layout) -> tuple[int, int]:
        """(tokens per micro-batch and rank, micro-batches in flight on the first stage)."""
        if layout.pp == 1:  # rl: the longest sequence gets a micro-batch of its own, split over cp
            s = self.s
            return (
                (
                    lc.tokens_per_rank(s.tokens, s.seq_len, layout.cp)
                    if s.recipe == "rl"
                    else s.tokens
                ),
                1,
            )
        seq = -(-self.s.seq_len // layout.tp) * layout.tp
        rows = max(1, self.s.tokens // seq)
        n_mb = self.s.pp_microbatches or layout.pp
        return rows * seq, n_mb if self.s.pp_schedule == "GPipe" else min(n_mb, layout.pp)

    # ---- one rank --------------------------------------------------------------------

    def rank(self, layout: Layout, kind: str, stages: list[list[int]] | None) -> RankPlan:
        s, args = self.s, self.args
        params = self.param_bytes(layout, stages)
        # FSDP2 CPU offload: shards and steps on the host
        on_device = 0 if s.cpu_offload else params
        # = on_device without LoRA
        trained = 0 if s.cpu_offload else self.param_bytes(layout, stages, trained=True)
        mine = list(range(args.num_layers)) if stages is None else [i for x in stages for i in x]
        n_moe = moe_layer_count(args, mine)
        first, last = 0 in mine, args.num_layers - 1 in mine
        tokens, in_flight = self.micro_batch(layout)
        act = activation_bytes(
            args,
            tokens,
            len(mine),
            s.compute_dtype,
            s.ac,
            layout.tp,
            first=first,
            last=last,
            vocab_parallel_head=layout.tp > 1 or layout.pp > 1,
            moe_layers=n_moe,
            ep=layout.ep,
        )
        update = {
            "parameters": on_device,
            "gradients": trained,
            "optimizer state": 2 * trained,
            "FSDP2 unsharded (transient)": self.unsharded_transient(layout, stages),
            "activations": act * in_flight,
        }
        if s.ac != "none":  # backward recomputes one block with nothing checkpointed
            one = activation_bytes(
                args,
                tokens,
                1,
                s.compute_dtype,
                "none",
                layout.tp,
                first=False,
                last=False,
                moe_layers=min(1, n_moe),
                ep=layout.ep,
            )
            update["recomputed block (transient)"] = one
        if n_moe:
            update["MoE dispatch (transient)"] = dispatch_transient(
                args, tokens, _elem(s.compute_dtype), layout.ep
            )
        if layout.cp > 1:
            ring = lc.cp_transient(args, tokens, _elem(s.compute_dtype), layout.cp, s.cp_style)
            update["cp attention (transient)"] = ring
        if last and layout.tp == 1 and layout.pp == 1:
            update["log-prob chunk (transient)"] = 2 * s.chunk_tokens * args.vocab_size * 4
        extra = 0
        if s.reference:
            extra += on_device
        if s.critic:
            critic = 0 if s.cpu_offload else self.param_bytes(layout, stages, skip="output")
            extra += 4 * critic  # its parameters, gradients and moments; value head not counted
        if extra:
            update["reference / critic"] = extra
        resident = self.resident(layout, stages)
        rollout: dict[str, float] = {}
        kv_seqs = 0
        if s.recipe == "rl":
            kv, kv_seqs = self.kv_pool(layout)
            rollout = {
                "resident training state": resident,
                "generation shard": self.generation_shard(layout.rollout_tp),
                "reshard buffers (at most)": min(
                    s.bucket_bytes, self.generation_shard(layout.rollout_tp)
                ),
                "KV pool": kv,
            }
            if s.lora is not None:  # the generation copy's base stays for the next rollout
                update["generation copy (kept, LoRA)"] = self.generation_shard(layout.rollout_tp)
        return RankPlan(kind, update, rollout, kv_seqs, self.freed_by_weight_dtype(layout))

    def plan(self, layout: Layout) -> list[RankPlan]:
        return [
            self.rank(layout, kind, stages)
            for kind, stages in rank_kinds(self.args, layout, self.s.pp_schedule)
        ]

    # ---- layouts ---------------------------------------------------------------------

    def resident(self, layout: Layout, stages: list[list[int]] | None) -> float:
        """What the update keeps on a rank of ``stages`` through the rollout, counted as the run
        counts it (`tandem.rl.rollout.sampling.resident_bytes`): the on-device shards only."""
        if self.s.cpu_offload:  # FSDP2 CPU offload: the shards live on the host
            return 0
        params = self.param_bytes(layout, stages)
        head = params - self.param_bytes(layout, stages, skip="output")
        return resident_bytes(
            params,
            head,
            offload_optimizer=self.s.offload_optimizer,
            reference=self.s.reference,
            critic=self.s.critic,
            trained_bytes=self.param_bytes(layout, stages, trained=True),
        )

    def resident_bytes(self, layout: Layout) -> float:
        """`resident` of the busiest rank: what the auto rollout.tp rule counts."""
        kinds = rank_kinds(self.args, layout, self.s.pp_schedule)
        return max(self.resident(layout, stages) for _, stages in kinds)

    def auto_rollout_tp(self, layout: Layout, device_bytes: float, devices_per_node: int) -> int:
        """The run's rule (`tandem.parallel.generation_layout.auto_tp`) on the target device."""
        return auto_tp(
            self.args,
            self.generation_shard,
            world=layout.world,
            devices_per_node=devices_per_node,
            device_bytes=device_bytes,
            resident_bytes=self.resident_bytes(layout),
            kv_bytes=self.s.kv_cache_gb * GB,
        )

    @property
    def _no_tp(self) -> bool:
        """GPT-OSS, DeepSeek-V3 and Qwen3.5 run tp = rollout.tp = 1 so far (Qwen3.5: pp = 1 and
        cp = 1 too; tandem/rl/config/composes.py)."""
        return self.args.model_type in (
            "gpt_oss",
            "deepseek_v3",
            "qwen3_5_text",
            "qwen3_5_moe_text",
        )

    def candidates(self, world: int, devices_per_node: int) -> list[Layout]:
        """Every FSDP2 x TP x PP layout of ``world`` ranks (TP within a node; TP and PP for the rl
        recipe only, as the other recipes shard with FSDP2 alone), least model parallelism first.
        An MoE model's (pp = 1 so far), by TP degree: without EP, then with ep = a node (EP groups
        within nodes), then ep = dp_shard, where ep divides the ranks and the experts; under TP
        only ep = dp_shard (tandem/parallel/expert_parallel.py's rules)."""
        tps = [
            tp
            for tp in range(1, min(world, devices_per_node) + 1)
            if world % tp == 0
            and check_divisible(self.args, tp) is None
            and (tp == 1 or self.s.recipe == "rl")
            and (tp == 1 or not self._no_tp)
        ]
        if self.args.is_moe:
            out = []
            for tp in tps:
                dp = world // tp
                sizes = (devices_per_node, dp) if tp == 1 else (dp,)
                eps = sorted(
                    {
                        e
                        for e in sizes
                        if 1 < e <= dp
                        and dp % e == 0
                        and self.args.num_experts % e == 0
                        # ep refused (composes.py)
                        and self.args.model_type not in ("gpt_oss", "qwen3_5_moe_text")
                    }
                )
                out += [Layout(dp_shard=dp, tp=tp, ep=ep) for ep in [1, *eps]]
            return out
        per = SCHEDULES[self.s.pp_schedule][1]
        out = []
        for tp in tps:
            for pp in range(1, min(world // tp, self.args.num_layers) + 1):
                if (world // tp) % pp or pp * (per if pp > 1 else 1) > self.args.num_layers:
                    continue
                if pp > 1 and (self.s.recipe != "rl" or self.args.linear is not None):
                    continue  # pipelining is the rl recipe's only (ParallelConfig); not Qwen3.5's
                out.append(Layout(pp=pp, dp_shard=world // (tp * pp), tp=tp))
        if self.s.recipe == "rl" and self.args.linear is None:  # FSDP2 x cp (long_context.py)
            out += [
                Layout(dp_shard=world // cp, cp=cp)
                for cp in lc.cp_degrees(
                    world, devices_per_node, self.args.num_heads, self.s.cp_style
                )
            ]
        # at equal degree, cp first when the longest sequence outgrows a micro-batch
        long = self.s.seq_len > self.s.tokens
        return sorted(out, key=lambda x: (x.tp * x.pp * x.cp, (x.cp == 1) == long, x.pp))

    def best(
        self, world: int, devices_per_node: int, device_bytes: float
    ) -> tuple[Layout, float] | None:
        """The first layout of `candidates` that fits, with its rollout.tp chosen by the auto rule;
        None when none does."""
        for lay in self.candidates(world, devices_per_node):
            lay = dataclasses.replace(
                lay,
                rollout_tp=self.auto_rollout_tp(lay, device_bytes, devices_per_node)
                if self.s.recipe == "rl"
                else 1,
            )
            peak = max(r.peak for r in self.plan(lay))
            if peak <= USABLE * device_bytes:
                return lay, peak
        return None

    def smallest(
        self, nodes: int, devices_per_node: int, device_bytes: float
    ) -> tuple[Layout, float] | None:
        """The fewest ranks (1, 2, 4, ... up to a node, then whole nodes: each count up to
        LINEAR_NODES, then doubling, then the whole cluster) on which some layout fits. The
        doubling keeps a cluster of many nodes to a few dozen searches."""
        worlds = [w for w in (1, 2, 4, 8, 16, 32, 64) if w < devices_per_node]
        counts = list(range(1, min(nodes, LINEAR_NODES) + 1))
        while counts[-1] < nodes:
            counts.append(min(2 * counts[-1], nodes))
        worlds += [devices_per_node * n for n in counts]
        for w in worlds:
            found = self.best(w, devices_per_node, device_bytes)
            if found:
                return found
        return None


# ---- train.py --plan -------------------------------------------------------------------
