"""The dense SwiGLU MLP of a transformer block (and of an MoE's shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.batch_invariant import lane_aligned


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w13: nn.Linear | None = None  # gate and up in one (`fuse`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(lane_aligned(F.silu, gate) * up)
        return self.w2(lane_aligned(F.silu, self.w1(x)) * self.w3(x))

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference layout: w1 and w3 become one projection ``w13`` (gate rows, then up rows)."""
        if self.w13 is not None:
            return
        w = torch.cat([self.w1.weight, self.w3.weight])
        del self.w1, self.w3
        self.w13 = linear_of(w, None)


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding these tensors (no fresh initialisation)."""
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin
