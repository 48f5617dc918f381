"""Activation checkpointing per transformer block, applied from outside the model.

Modes:
- ``"none"``: nothing.
- ``"full"``: every block is wrapped with ``checkpoint_wrapper``; only block
  inputs are kept, the whole block is recomputed in backward.
- ``"selective"``: *op-level* selective checkpointing on every block
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): outputs of
  matmuls, attention kernels and TP reduce-scatters / all-reduces are saved, and
  the cheap, memory-heavy elementwise work (norms, RoPE, SiLU, residual adds,
  casts) is recomputed. Saving collectives means backward never repeats a TP
  communication.

Wrapping replaces ``model.layers[name]`` with a ``CheckpointWrapper``; its
parameters gain a ``_checkpoint_wrapped_module.`` prefix in ``named_parameters``
(``state_dict`` strips it), see `clean_fqn`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["AC_MODES", "apply_ac", "clean_fqn"]

AC_MODES = ("none", "full", "selective")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _save_ops() -> set[Any]:
    names = [
        ("aten", "mm"),
        ("aten", "addmm"),
        ("aten", "bmm"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        ("_c10d_functional", "reduce_scatter_tensor"),
        ("_c10d_functional", "all_reduce"),
    ]
    ops: set[Any] = set()
    for ns, name in names:
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _policy(save: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(partial(_policy, _save_ops()))


def apply_ac(model: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint each block of ``model.layers`` per ``mode`` (see module docstring), in place."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return model
    for name, block in list(model.layers.named_children()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False, context_fn=_selective_context
            )
        model.layers[name] = wrapped
    return model


def clean_fqn(name: str) -> str:
    """A parameter name with checkpoint / compile wrapper prefixes removed."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name
