"""How long one checkpoint takes to write, from the model's shapes: the planner's estimate that
``tandem-k8s render`` turns into ``terminationGracePeriodSeconds`` (tandem/k8s/render.py).

A DCP checkpoint holds every parameter in its stored dtype (float32 under FSDP2's mixed
precision) and, unless ``checkpoint.model_only``, AdamW's two float32 moments of each trainable
one (a critic adds its own copy). The nodes write their shards at once, so the time is the bytes
of the busiest node over one node's write bandwidth; counting frozen LoRA bases in full makes
it an upper bound there.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.models.lora import is_adapter
from tandem.rl.plan.cli import plan_args
from tandem.rl.plan.planner import Settings, param_shapes

FP32 = 4


def checkpoint_bytes(cfg: Any) -> int:
    """Bytes of one checkpoint of ``cfg``'s run (all ranks together)."""
    args, _ = plan_args(cfg)
    lora = cfg.lora.spec() if cfg.lora.enabled else None
    shapes = param_shapes(args, lora)
    total = sum(math.prod(s) for _, s in shapes)
    trainable = sum(math.prod(s) for n, s in shapes if is_adapter(n)) if lora is not None else total
    moments = 0 if cfg.checkpoint.model_only else 2 * trainable
    copies = 2 if Settings.from_config(cfg).critic else 1
    return copies * FP32 * (total + moments)


def checkpoint_seconds(cfg: Any, nodes: int, write_gbps: float) -> float:
    """Seconds one checkpoint takes on ``nodes`` nodes that each write ``write_gbps`` GB/s."""
    return checkpoint_bytes(cfg) / max(1, nodes) / (write_gbps * 1e9)
