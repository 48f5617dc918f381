"""Choose between a Triton kernel and its PyTorch reference.

Every kernel in ``kernels/`` has two implementations: a Triton kernel for CUDA
and a plain-PyTorch reference that runs anywhere. Callers never choose; the
public function of each kernel asks `use_triton` with its main input tensor and
the caller's optional ``impl`` override.

Precedence, most specific first:

1. ``impl="triton" | "torch"`` passed to the kernel call;
2. the process's choice, `set_kernels` (the trainer sets it from ``advanced.kernels``);
3. Triton when the tensor is on CUDA and Triton is installed, else the reference.

Forcing Triton on a CPU tensor only works under the Triton interpreter
(``TRITON_INTERPRET=1``, which must be set before ``triton`` is first imported,
e.g. in a test ``conftest.py``); otherwise `use_triton` raises instead of failing deep inside
Triton's launcher.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from tandem import device as seam

IMPLS = ("triton", "torch")
_chosen: str | None = None  # set_kernels: the process's choice; None = by device


def set_kernels(impl: str | None) -> None:
    """Every kernel call of this process without an ``impl`` of its own takes ``impl``
    ("triton" | "torch"); None (or "auto") goes back to choosing by device."""
    global _chosen
    impl = None if impl == "auto" else impl
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"kernels: {impl!r} is not one of auto, {', '.join(IMPLS)}")
    _chosen = impl


def chosen_kernels() -> str | None:
    """The process's choice (`set_kernels`), None when it chooses by device."""
    return _chosen


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return seam.triton_installed()


def triton_interpreting() -> bool:
    """Whether Triton kernels will run under the CPU interpreter.

    ``TRITON_INTERPRET`` must be set, and must have been set before ``triton.language``
    was imported: Triton decorates its own standard library (``tl.zeros``, ``tl.sum``,
    ...) at import, and compiled-mode versions of those fail inside interpreted kernels.
    """
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return False
    tl = sys.modules.get("triton.language")
    return tl is None or type(getattr(tl, "zeros", None)).__name__ == "InterpretedFunction"


def requested_impl(impl: str | None) -> str | None:
    """The forced implementation, from the argument or else the process's choice, or None."""
    if impl is None:
        return _chosen
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    return impl


def use_triton(t: torch.Tensor, impl: str | None = None) -> bool:
    """True when the Triton kernel should handle ``t``, False for the PyTorch reference.

    See the module docstring for the precedence of ``impl``, `set_kernels` and
    the device. Raises if Triton is forced but cannot run here.
    """
    forced = requested_impl(impl)
    if forced == "torch":
        return False
    if forced is None:
        if seam.triton_supported(t.device):
            return True
        seam.fallback(t.device, "kernels", "Triton backend (the PyTorch references run)")
        return False
    if not triton_available():
        raise RuntimeError("Triton kernels were requested but triton is not installed")
    if t.device.type == "cpu" and not triton_interpreting():
        raise RuntimeError(
            "Triton kernels were requested for a CPU tensor; set TRITON_INTERPRET=1 "
            "before triton is first imported to run them under the interpreter"
        )
    return True
