"""Tensor parallelism (Megatron-style, with sequence parallel) applied from outside the model.

`apply_tp` plans each block: q/k/v and the MLP's gate/up column-parallel, the output
projections row-parallel, norms sequence-parallel, MoE experts split by hidden features
(tandem/parallel/moe_tp.py), and the embedding and head split by vocabulary rows so
tandem/parallel/loss.py reads log-probs without gathering ``[B, S, V]``. The model knows
nothing of it: `apply_tp` sets the attention's local head counts and a pre-hook supplies
full-length positions under sequence parallel. The plan in full: docs/internals.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tandem.parallel.lora import lora_plan
from tandem.parallel.moe_tp import moe_block_plan, shard_experts_tp

__all__ = ["apply_tp", "validate_tp"]


def validate_tp(args: Any, tp: int) -> None:
    """Raise ValueError (one line) unless ``tp`` divides heads, kv heads and the MLP widths
    (an MoE model's expert and shared-expert widths too)."""
    if tp < 1:
        raise ValueError(f"tensor parallel degree must be >= 1, got tp={tp}")
    names = ["num_heads", "num_kv_heads", "intermediate_size"]
    if getattr(args, "num_experts", 0):
        names += ["moe_intermediate_size", "shared_expert_intermediate_size"]
    for name in names:
        value = getattr(args, name)
        if value % tp:
            raise ValueError(
                f"tensor parallel degree tp={tp} must divide {name}={value} "
                f"(num_heads={args.num_heads}, num_kv_heads={args.num_kv_heads}, "
                f"intermediate_size={args.intermediate_size})"
            )


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    vocab_parallel: bool = True,
    shard_experts: bool = True,
) -> nn.Module:
    """Shard ``model`` (a Transformer or one pipeline stage of it) over ``tp_mesh`` in place.

    With ``vocab_parallel`` the output is a DTensor of logits sharded on the vocab
    dim; feed it to `tandem.parallel.loss.vocab_parallel_token_logprobs`. Without it the
    logits are gathered into a plain ``[B, S, V]`` tensor. The embedding is
    row-parallel (vocab rows split) either way. ``shard_experts=False`` leaves MoE experts to
    expert parallelism (tandem/parallel/expert_parallel.py splits them over (dp_shard, tp)).
    """
    tp = tp_mesh.size()
    validate_tp(model.args, tp)
    if tp == 1:
        return model
    # e.g. a LoRA run's base
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    stream = Shard(1) if sequence_parallel else Replicate()  # residual stream between blocks

    root_plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        # Always row-parallel (vocab rows split): a lookup is cheap to shard either way.
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream
        )
    if model.norm is not None and sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = (
            ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
            if vocab_parallel
            else ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
        if hasattr(block, "moe") and shard_experts:
            shard_experts_tp(block.moe.experts, tp_mesh)
        attn = block.attention
        attn.num_heads //= tp
        attn.num_kv_heads //= tp

    if sequence_parallel:
        model.register_forward_pre_hook(_make_positions_hook(tp), with_kwargs=True)
    _retie(model)
    for name, p in model.named_parameters():
        # torch's SequenceParallel makes fresh (trainable) Parameters
        if name in frozen:
            p.requires_grad_(False)
    _register_grad_placement_hooks(model)
    return model


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The parallelize_module plan of one TransformerBlock."""
    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out),
    }
    if hasattr(block, "moe"):  # tandem/parallel/moe_tp.py: every rank routes all the block's tokens
        plan.update(moe_block_plan(block, out))
    else:
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=out)
    if block.attention.q_norm is not None:
        # Per-head norm on the local heads [B, S, H/tp, Dh]: heads dim 2 plays "sequence".
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        # attention(x, cos, sin, attn) / feed_forward(x): gather x's positions.
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
        if not hasattr(block, "moe"):
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
    # adapted linears: their adapters split with them (tandem/parallel/lora.py)
    return lora_plan(block, plan)


def _make_positions_hook(tp: int):
    """Root pre-hook: default positions from the *global* sequence length under SP.

    Token ids arrive whole ``[B, S]``; hidden states entering a later pipeline stage
    arrive as this rank's sequence shard ``[B, S/tp, D]``.
    """

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs["x"]
        if module.tok_embeddings is not None:
            s = x.shape[1]
            if s % tp:
                raise ValueError(
                    f"sequence parallel needs the sequence length ({s}) divisible by tp={tp}; "
                    "pad the batch to a multiple of tp"
                )
        else:
            s = x.shape[1] * tp
        if kwargs.get("positions") is None:
            b = x.shape[0]
            kwargs = {**kwargs, "positions": torch.arange(s, device=x.device).expand(b, s)}
        return args, kwargs

    return hook


def _register_grad_placement_hooks(model: nn.Module) -> None:
    """Give every DTensor parameter's gradient the parameter's own placements.

    DTensor autograd leaves a replicated weight used on sharded activations (the
    SP norms, q/k-norm) with a ``Partial`` gradient, and the row-parallel
    embedding with a ``Replicate`` one. DTensor ops still compute correctly on
    those (torch's AdamW then redistributes inside each op that reads the grad,
    i.e. several all-reduces per parameter per step), but anything reading
    ``grad.to_local()`` — fused optimizers, norm/clipping code, checkpoints —
    would see a partial sum. So at the end of every backward through the model,
    grads are redistributed once to their parameter's placements (an all-reduce
    over TP for Partial, a local slice for Replicate -> Shard).

    Why not per-parameter grad hooks: ``to_empty`` after a meta-device
    parallelize swaps DTensor parameter internals (``swap_tensors``), which drops
    hooks registered before it. Instead a hook on the model *output* (created
    fresh each forward) queues an end-of-backward engine callback. FSDP2, when
    applied on top, replaces these parameters and redistributes itself; the
    callback then finds nothing to do.
    """

    def sync_grads() -> None:
        for param in model.parameters():
            grad = param.grad
            if isinstance(param, DTensor) and isinstance(grad, DTensor):
                if grad.placements != param.placements:
                    param.grad = grad.redistribute(param.device_mesh, param.placements)

    def on_output_grad(grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(sync_grads)

    def forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(on_output_grad)

    model.register_forward_hook(forward_hook)


def _retie(model: nn.Module) -> None:
    """parallelize_module replaces parameters one module at a time; re-share a tied head."""
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
