"""A model in the update layout: one FSDP2 x TP model, or this rank's pipeline stages.

The RL loop talks to the policy (and the frozen reference) only through this
interface, so it never branches on the layout:

- ``logprobs(samples, width)``: the completion tokens' log-probs ``[N, width]``
  (old / reference), no autograd;
- ``accumulate(samples, rows, inp, spec, norm, width)``: forward + backward of
  one optimizer step's rows, gradients accumulated; returns their `UpdateSums`;
- ``clip(max_norm)``, ``full_state()`` (the whole model on every rank, for the
  generation copy and the HF export), ``state_module`` (the full model's
  parameter names, for DCP), ``counts_stats`` (the one rank per data-parallel
  replica whose loss statistics are summed into the logs).

Every rank of a model-parallel group (its TP and PP ranks) holds the same
samples. `FlatPolicy`: FSDP2 over the data-parallel ranks and TP (log-probs
from the vocab-sharded head, never gathered) over ``mesh["tp"]``; micro-batches
are packed rows of about ``rl.micro_batch_tokens`` tokens. `PipelinePolicy`:
the layers split into stages (tandem/parallel/pp.py) under a torch schedule; one
sample per row, rows right-padded to a fixed length (the schedule fixes
activation shapes at its first step), the loss on the last stage, and
old / reference log-probs by a forward-only pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tandem.models.args import ModelArgs
from tandem.models.lora import apply_lora, lora_spec_of
from tandem.models.moe import router_loss, set_token_mask
from tandem.models.transformer import Transformer
from tandem.parallel.cp import ContextParallel
from tandem.parallel.grad import clip_grad_norm
from tandem.parallel.loss import token_logprobs_at
from tandem.parallel.mesh import Degrees, dp_rank
from tandem.parallel.pp import SCHEDULES, build_pipeline, pipeline_split
from tandem.parallel.tp import validate_tp
from tandem.rl.config.schema import ConfigError
from tandem.rl.core.lora import LoraConfig, save_exports
from tandem.rl.core.modeling import (
    BuildSpec,
    build_transformer,
    export_hf,
    full_initial_state,
    lora_shapes,
    parallelize_model,
    with_adapters,
)
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import (
    LossInputs,
    LossSpec,
    UpdateSums,
    completion_loss,
    micro_batch_loss,
    recompute_logprobs,
    scatter_completions,
)
from tandem.rl.update.packing import MicroBatch, pack_micro_batches, sync_micro_batch_count
from tandem.rl.update.router_stats import RouterStats, RoutingCheck
from tandem.rl.update.vision import attach_images


class FlatPolicy:
    """One model: FSDP2 over the data-parallel ranks, TP over ``mesh["tp"]``."""

    def __init__(
        self,
        args: ModelArgs,
        mesh: Any,
        device: torch.device,
        *,
        path: str | None,
        seed: int,
        spec: BuildSpec,
        is_main: bool,
        trainable: bool = True,
        micro_batch_tokens: int,
        chunk_tokens: int,
        share_prompts: bool = False,
        cp_style: str = "ulysses",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group  # the ranks this policy trains on (None: the whole world)
        self.cp = context_parallel(mesh, cp_style)
        self.device, self.chunk = device, chunk_tokens
        self.budget = micro_batch_tokens * self.cp.size  # each cp rank: micro_batch_tokens
        self.share_prompts = share_prompts
        self.tp = mesh["tp"].size()
        self.dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
        self.dp_rank = dp_rank(mesh)  # TP ranks of one replica share it (and their samples)
        self.model = build_transformer(
            args, path, seed, mesh, device, spec, is_main=is_main, trainable=trainable
        )
        self.modules = [self.model]
        self.state_module = self.model
        self.tp_rank = mesh["tp"].get_local_rank()
        self.counts_stats = self.tp_rank == 0 and mesh["cp"].get_local_rank() == 0
        self.kv_wrap: Callable[[Any], Any] | None = None  # FP8 KV: attention wrapper (kv_scales.py)
        self.moe = RouterStats()
        self.routing = RoutingCheck()
        self.is_moe = args.is_moe
        self.image_token_id = args.vision.image_token_id if args.vision is not None else None

    @property
    def vocab_parallel(self) -> bool:
        return self.tp > 1

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def micro_batches(self, samples: list[RolloutSample], rows: list[int]) -> list[MicroBatch]:
        """Packed micro-batches of ``rows``, as many on every rank (FSDP2's collectives
        must match)."""
        multiple = self.tp * self.cp.granularity  # TP's sequence-parallel pieces; cp's chunks
        mbs = pack_micro_batches(
            samples,
            rows,
            self.budget,
            self.device,
            multiple=multiple,
            share_prompts=self.share_prompts,
        )
        if self.image_token_id is not None:
            # a vision-language policy: M-RoPE positions, image rows
            mbs = [attach_images(mb, samples, self.image_token_id) for mb in mbs]
        return sync_micro_batch_count(mbs, self.device, width=multiple, group=self.group)

    @property
    def split(self) -> ContextParallel | None:
        """The cp group the rows are split over (None: cp = 1)."""
        return self.cp if self.cp.size > 1 else None

    def _wrapped(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        for mb in mbs:
            mb.kv_wrap = self.kv_wrap
        return mbs

    def logprobs(self, samples: list[RolloutSample], width: int) -> torch.Tensor:
        mbs = self._wrapped(self.micro_batches(samples, list(range(len(samples)))))
        out = recompute_logprobs(
            self.model,
            samples,
            mbs,
            width,
            self.device,
            self.chunk,
            vocab_parallel=self.vocab_parallel,
            cp=self.split,
            after=lambda mb: self.routing.observe(self.model, mb),
        )
        self.routing.disarm()  # compared once, with the rollout's weights
        return out

    def accumulate(
        self,
        samples: list[RolloutSample],
        rows: list[int],
        inp: LossInputs,
        spec: LossSpec,
        norm: Any,
        width: int,
    ) -> UpdateSums:
        """Forward + backward over ``rows``; returns their loss and token sums."""
        sums = UpdateSums.zeros(self.device)
        mbs = self._wrapped(self.micro_batches(samples, rows))
        spec = dataclasses.replace(spec, cp=self.split)
        for mb in mbs:
            if self.is_moe:
                set_token_mask(self.model, mb.doc_ids >= 0)  # MoE router losses: not the padding
            loss, st = micro_batch_loss(self.model, mb, inp, spec, norm, width)
            self.routing.observe(self.model, mb)
            # MoE: the router's losses, mean over micro-batches and over the data-parallel
            # ranks: ``loss`` is this rank's share of a global sum, so its router term is 1/dp
            router = router_loss(self.model) if mb.rows else None
            if router is not None:
                self.moe.observe(self.model)
                loss = loss + router / (len(mbs) * self.dp)
            (loss * self.dp * self.cp.size).backward()  # FSDP2 averages over dp x cp ranks
            if self.is_moe:  # after the backward: checkpointing replays the forward
                set_token_mask(self.model, None)
            if st:
                sums.add_loss(loss, st)
        return sums

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(self.model.parameters(), max_norm)

    def cp_metrics(self) -> dict[str, float]:
        """Collective where cp > 1: the split the attention guards measured, smallest over ranks."""
        return cp_metrics(self.split, self.device, self.group)

    def export_hf(self, args: ModelArgs, tokenizer: Any, out_dir: str, rank: int) -> None:
        """Collective: the policy as an HF folder (rank 0 writes)."""
        export_hf(self.model, args, tokenizer, out_dir, rank)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) state dict on every rank, on its device."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))


class _StageUnion(nn.Module):
    """This rank's pipeline stages as one module with the whole model's parameter names.

    DCP then writes and reads the same keys as a one-model layout, so a
    checkpoint moves between pipeline and non-pipeline layouts. The last
    stage's copy of a tied weight is registered under ``tok_embeddings`` first,
    so the optimizer state is keyed ``tok_embeddings.weight`` as well.
    """

    def __init__(self, stages: list[nn.Module], tied: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        first = next((m.tok_embeddings for m in stages if m.tok_embeddings is not None), None)
        last = next((m for m in stages if m.output is not None), None)
        if first is not None:
            self.tok_embeddings = first
        elif tied and last is not None:
            holder = nn.Module()
            holder.weight = last.output.weight
            self.tok_embeddings = holder
        for m in stages:
            for name, layer in m.layers.items():
                self.layers[name] = layer
        if last is not None:
            self.norm = last.norm
            self.output = last.output


class PipelinePolicy:
    """This rank's pipeline stages (tandem/parallel/pp.py), each also TP- and FSDP2-parallel."""

    def __init__(
        self,
        args: ModelArgs,
        mesh: Any,
        device: torch.device,
        *,
        path: str | None,
        seed: int,
        spec: BuildSpec,
        trainable: bool = True,
        schedule: str,
        microbatches: int,
        seq_len: int,
        micro_batch_tokens: int,
        chunk_tokens: int = 1024,
        is_main: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        # the last stage holds whole logits rows; every rank reads its own weights
        del chunk_tokens, is_main
        self.group = group  # the ranks this policy trains on (None: the whole world)
        self.device, self.args = device, args
        self.tp = mesh["tp"].size()
        self.dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
        self.seq_len = -(-seq_len // self.tp) * self.tp
        self.n_mb = microbatches or mesh["pp"].size()
        self.rows_per_mb = max(1, micro_batch_tokens // self.seq_len)
        self.batch_rows = self.n_mb * self.rows_per_mb
        # each rank reads it: stages load different keys
        full = full_initial_state(args, path, seed)
        lora = spec.lora if trainable else None
        if lora is not None:  # LoRA: every stage's adapters, drawn for the whole model as one
            full = with_adapters(full, lora, lora_shapes(args, lora))

        def prepare(stage: nn.Module) -> nn.Module:
            if lora is not None:
                apply_lora(stage, lora.spec)
            parallelize_model(stage, mesh, device, spec, trainable=trainable)
            stage.to_empty(device=device)
            stage.reset_rope()
            own = {k: full[k] for k in get_model_state_dict(stage)}
            set_model_state_dict(
                stage, own, options=StateDictOptions(full_state_dict=True, strict=True)
            )
            return stage

        with torch.device("meta"):
            meta = Transformer(args)
        self.pipe = build_pipeline(
            meta, mesh["pp"], schedule, self.n_mb, self._loss, device=device, parallelize_fn=prepare
        )
        full.clear()
        self.modules = self.pipe.modules
        if not trainable:
            for m in self.modules:
                m.requires_grad_(False).eval()
        self.state_module = _StageUnion(self.modules, tied=self.pipe.tied_group is not None)
        self.moe = RouterStats()  # never fed: MoE models run without pipeline stages so far
        self.routing = RoutingCheck()
        self.cp, self.split = ContextParallel(None), None  # parallel.cp needs pp = 1 (check_layout)
        self.counts_stats = self.pipe.has_last_stage and mesh["tp"].get_local_rank() == 0
        self.vocab_parallel = self.tp > 1
        self._ctx: dict[str, Any] = {}
        if trainable:
            self._warm_up()

    def _warm_up(self) -> None:
        """One all-padding step: torch's schedule infers stage shapes at its first step by
        calling the loss on placeholder activations, which must not reach the statistics."""
        tokens = torch.zeros(self.batch_rows, self.seq_len, dtype=torch.long, device=self.device)
        pad = torch.full_like(tokens, -1)
        self.pipe.step(tokens, targets={"targets": tokens, "row": pad, "col": pad})
        for p in self.parameters():
            p.grad = None

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def train(self) -> None:
        for m in self.modules:
            m.train()

    def eval(self) -> None:
        for m in self.modules:
            m.eval()

    # ---- batches: one sample per row, [batch_rows, seq_len] ----------------------------

    def _batches(
        self, samples: list[RolloutSample], rows: list[int]
    ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """(tokens, targets) per pipeline step; targets hold per position the next token, the
        sample index (``row``, -1 on padding) and the completion column (``col``, -1 elsewhere)."""
        per = self.batch_rows
        n = -(-len(rows) // per) if rows else 0
        count = torch.tensor([n], device=self.device)
        # the same number of steps on every rank
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        out = []
        for b in range(int(count.item())):
            chunk = rows[b * per : (b + 1) * per]
            tok = torch.zeros(per, self.seq_len, dtype=torch.long)
            tgt = torch.zeros(per, self.seq_len, dtype=torch.long)
            row = torch.full((per, self.seq_len), -1, dtype=torch.long)
            col = torch.full((per, self.seq_len), -1, dtype=torch.long)
            for r, i in enumerate(chunk):
                s = samples[i]
                seq = s.prompt_ids + s.completion_ids
                n_in, p = len(seq) - 1, len(s.prompt_ids)
                if n_in > self.seq_len:
                    raise ValueError(
                        f"a sequence of {n_in + 1} tokens exceeds the pipeline row "
                        f"length {self.seq_len}"
                    )
                tok[r, :n_in] = torch.tensor(seq[:-1])
                tgt[r, :n_in] = torch.tensor(seq[1:])
                row[r, p - 1 : n_in] = i
                col[r, p - 1 : n_in] = torch.arange(len(s.completion_ids))
            dev = self.device
            out.append(
                (tok.to(dev), {"targets": tgt.to(dev), "row": row.to(dev), "col": col.to(dev)})
            )
        return out

    @staticmethod
    def _completions(t: dict[str, torch.Tensor]) -> MicroBatch:
        """The completion positions of one pipeline microbatch, as a MicroBatch's ``comp_*``."""
        col = t["col"].reshape(-1)
        index = (col >= 0).nonzero()[:, 0]
        rows = t["row"].reshape(-1)[index]
        uniq, local = torch.unique(rows, return_inverse=True)  # sorted sample indices
        z = index.new_zeros(0)
        return MicroBatch(uniq.tolist(), z, z, z, t["targets"], [], index, local, col[index])

    # ---- loss on the last stage --------------------------------------------------------

    def _loss(self, logits: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        c = self._ctx
        mb = self._completions(t)
        logp, ent = token_logprobs_at(
            logits, mb.comp_index, t["targets"].reshape(-1)[mb.comp_index], with_entropy=True
        )
        if not c:  # the warm-up step
            return logp.sum() * 0.0
        loss, st = completion_loss(logp, ent, mb, c["inp"], c["spec"], c["norm"], c["width"])
        if st:
            c["sums"].add_loss(loss, st)
        return loss * self.dp  # FSDP2 averages over dp ranks

    def accumulate(
        self,
        samples: list[RolloutSample],
        rows: list[int],
        inp: LossInputs,
        spec: LossSpec,
        norm: Any,
        width: int,
    ) -> UpdateSums:
        sums = UpdateSums.zeros(self.device)
        self._ctx = {"inp": inp, "spec": spec, "norm": norm, "width": width, "sums": sums}
        for tokens, targets in self._batches(samples, rows):
            self.pipe.step(tokens, targets=targets)
        self.pipe.sync_tied_grads()
        self._ctx = {}
        return sums

    def logprobs(self, samples: list[RolloutSample], width: int) -> torch.Tensor:
        """Forward only through the stages; computed on the last stage, broadcast to the others."""
        out = torch.zeros(len(samples), width, device=self.device)
        for tokens, targets in self._batches(samples, list(range(len(samples)))):
            mbs = [
                {
                    k: v[i * self.rows_per_mb : (i + 1) * self.rows_per_mb]
                    for k, v in targets.items()
                }
                for i in range(self.n_mb)
            ]

            def record(i: int, logits: torch.Tensor, mbs=mbs) -> None:
                mb = self._completions(mbs[i])
                logp, _ = token_logprobs_at(
                    logits,
                    mb.comp_index,
                    mbs[i]["targets"].reshape(-1)[mb.comp_index],
                    with_entropy=False,
                )
                if mb.rows:
                    out[mb.rows] = scatter_completions(logp, mb, width)

            self.pipe.forward_only(list(tokens.split(self.rows_per_mb)), record, device=self.device)
        last = dist.get_world_size(self.pipe.group) - 1
        dist.broadcast(out, group_src=last, group=self.pipe.group)
        return out

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(
            self.parameters(),
            max_norm,
            group=self.pipe.group,
            duplicates=self.pipe.duplicate_params(),
        )

    def cp_metrics(self) -> dict[str, float]:
        return {}

    def export_hf(self, args: ModelArgs, tokenizer: Any, out_dir: str, rank: int) -> None:
        """Collective: the policy as an HF folder (rank 0 writes)."""
        full = self.full_state()
        if rank == 0:
            save_exports(
                {k: v.cpu() for k, v in full.items()},
                args,
                out_dir,
                tokenizer,
                lora_spec_of(self.modules[0]),
            )

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model on every rank (stages gathered over FSDP / TP, then
        broadcast over the pipeline from each stage's rank)."""
        local: dict[str, torch.Tensor] = {}
        for m in self.modules:
            local.update(get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)))
        group = self.pipe.group
        metas: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(
            metas, [(k, tuple(v.shape), v.dtype) for k, v in local.items()], group=group
        )
        me = dist.get_rank(group)
        full: dict[str, torch.Tensor] = {}
        for src, keys in enumerate(metas):
            for k, shape, dtype in keys:
                t = (
                    local[k].contiguous()
                    if src == me
                    else torch.empty(shape, dtype=dtype, device=self.device)
                )
                dist.broadcast(t, group_src=src, group=group)
                full[k] = t
        return full


def check_layout(
    args: ModelArgs, degrees: Degrees, pp_schedule: str, cp_style: str = "ulysses"
) -> None:
    """One clear line (ConfigError) when the model cannot be split as ``[parallel]`` asks."""
    try:
        validate_tp(args, degrees.tp)
    except ValueError as e:
        raise ConfigError(f"parallel.tp: {e}") from None
    if degrees.cp > 1 and cp_style == "ulysses" and args.num_heads % degrees.cp:
        raise ConfigError(
            f"parallel.cp: ulysses splits the {args.num_heads} attention heads "
            f"over cp = {degrees.cp} ranks, which must divide them; set "
            "parallel.cp_style = 'ring'"
        )
    try:
        pipeline_split(
            args, degrees.pp, stages_per_rank=SCHEDULES[pp_schedule][1] if degrees.pp > 1 else 1
        )
    except ValueError as e:
        raise ConfigError(f"parallel.pp: {e}") from None


def context_parallel(mesh: Any, style: str) -> ContextParallel:
    """The mesh's cp group (None at cp = 1) with ``parallel.cp_style``."""
    return ContextParallel(mesh["cp"].get_group() if mesh["cp"].size() > 1 else None, style)


def cp_metrics(
    cp: ContextParallel | None, device: torch.device, group: dist.ProcessGroup | None
) -> dict[str, float]:
    """``update/cp_effective``: the split the attention guards measured since the last call, the
    smallest over the ranks of ``group`` (a collective; nothing at cp = 1)."""
    if cp is None:
        return {}
    t = torch.tensor([cp.take_effective()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return {"update/cp_effective": t.item()}


def build_policy(
    args: ModelArgs,
    mesh: Any,
    device: torch.device,
    *,
    pp_schedule: str,
    pp_microbatches: int,
    seq_len: int,
    micro_batch_tokens: int,
    chunk_tokens: int,
    share_prompts: bool = False,
    lora: LoraConfig | None = None,
    cp_style: str = "ulysses",
    **build: Any,
) -> FlatPolicy | PipelinePolicy:
    """`PipelinePolicy` when ``mesh["pp"]`` has more than one rank, else `FlatPolicy`; with ``lora``
    (the ``[lora]`` section, rank > 0) a frozen base with adapters (tandem/rl/core/lora.py)."""
    if lora is not None and lora.enabled:
        setup = lora.setup(build["seed"], base_model=build.get("path"))
        build["spec"] = dataclasses.replace(build["spec"], lora=setup)
    if mesh["pp"].size() > 1:
        return PipelinePolicy(
            args,
            mesh,
            device,
            schedule=pp_schedule,
            microbatches=pp_microbatches,
            seq_len=seq_len,
            micro_batch_tokens=micro_batch_tokens,
            chunk_tokens=chunk_tokens,
            **build,
        )
    return FlatPolicy(
        args,
        mesh,
        device,
        micro_batch_tokens=micro_batch_tokens,
        chunk_tokens=chunk_tokens,
        share_prompts=share_prompts,
        cp_style=cp_style,
        **build,
    )
