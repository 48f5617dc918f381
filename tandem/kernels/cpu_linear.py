"""oneDNN matmuls for the gradient-free fp32 linears of a CPU generation copy.

On the CPU, ``F.linear`` in fp32 goes to MKL's sgemm. oneDNN, which PyTorch also ships, was
faster at the rollout's small decode products on the AMD EPYC machines of earlier sessions
(where ``MKL_VERBOSE`` reported MKL's generic code path) and slower on an Intel Xeon with AMX,
so the rollout copy uses it only where ``rollout.cpu_onednn`` asks (docs/performance.md).

`OneDNNLinear` is an ``nn.Linear`` whose forward takes that route when nothing
needs a gradient and the tensors are plain fp32 CPU tensors; anything else
(autograd, DTensor shards, CUDA, other dtypes) runs ``F.linear`` as before.
The results differ from MKL's only by summation order (a few fp32 ulps).
`use_onednn_linears` also reorders each weight once into oneDNN's blocked
layout (a second copy of it, kept beside the plain one). A weight changed in place
after that is seen (its version is checked) and used plain.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear op (x86 and Arm CPU wheels do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = _onednn(torch.ones(1, 2), torch.ones(3, 2), None)
    except (AttributeError, RuntimeError):
        return False
    return out.shape == (1, 3) and bool((out == 2).all())


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` that runs oneDNN's matmul for gradient-free fp32 CPU calls."""

    packed: tuple[torch.Tensor, int] | None = None  # (blocked copy of the weight, the weight's
    # version then)

    def pack(self) -> None:
        """Keep a copy of the weight in oneDNN's blocked layout for the calls above."""
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and _plain(w):
            self.packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), None), w._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (
            x.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and _plain(x)
            and _plain(w)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            if self.packed is not None and self.packed[1] == w._version:
                w = self.packed[0]
            return _onednn(x, w, b)
        return F.linear(x, w, b)


def use_onednn_linears(model: nn.Module, pack: bool = True) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a `OneDNNLinear` in place (same
    parameters, same state dict) and, with ``pack``, give each a blocked copy of its
    weight (`OneDNNLinear.pack`); returns how many. Does nothing without oneDNN."""
    if not onednn_linear_available():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDNNLinear
            if pack:
                m.pack()
            n += 1
    return n
