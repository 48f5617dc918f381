"""Per-block ``torch.compile``, applied after TP and activation checkpointing, before FSDP.

Each block is compiled in place with ``nn.Module.compile`` (same module object,
parameter names unchanged), so FSDP2 wraps compiled blocks and its
communication stays outside the compiled graphs. All blocks share one code
object, so dynamo compiles once and reuses the graph for every layer.
"""

from __future__ import annotations

from torch import nn

__all__ = ["apply_compile"]


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False
) -> nn.Module:
    """Compile every block of ``model.layers`` in place; returns ``model``."""
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)
    return model
