"""Move optimizer state between the accelerator and host memory (rollout offload)."""

from __future__ import annotations

import torch


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every state tensor of ``opt`` to ``device``; returns the bytes moved."""
    moved = 0
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != torch.device(device) and v.dim() > 0:
                state[k] = v.to(device, non_blocking=True)
                moved += v.numel() * v.element_size()
    return moved
