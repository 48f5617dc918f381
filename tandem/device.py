"""The one device seam: everything Tandem asks of an accelerator, over ``torch.accelerator``.

The rest of the code never names a vendor (tests/test_layout_rules.py fails on ``torch.cuda``
or ``"nccl"`` outside this file): it asks what the device *can* do, `capabilities`, and takes
the fallback when a capability is missing. A device type is one row of `DEVICES`; a type with
no row (a PrivateUse1 backend such as torch_npu's ``npu`` before it has one, or PyTorch's test
accelerator ``openreg``) gets `GENERIC`: collectives over gloo, no graphs, no Triton, the plain
PyTorch kernels. docs/devices.md has the table and what to do on Ascend and ROCm.

What stays CUDA-specific here, and why: graph capture and the multiprocessor count go through
``torch.cuda`` because that is the path that ran on an H100/H200; ``torch.accelerator.Graph``
exists in this torch, but no other device type has run Tandem's decode graphs yet.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capabilities:
    """What one device type can do; each feature asks for the field it needs."""

    backend: str  # process-group backend (torch.distributed's "device:backend" list)
    collective: str = "gloo"  # the backend's name for device tensors (in dist.get_backend)
    dispatch_key: str = "PrivateUse1"  # aten dispatch key: where rl.exact's matmuls register
    graphs: bool = False  # decode steps may be captured and replayed as one graph
    triton: bool = False  # Triton has a backend for it: kernels/ pick Triton, else PyTorch
    memory_stats: bool = True  # torch.accelerator.memory_* answer (peak/allocated metrics)
    pinned: bool = True  # host copies may be page-locked (offloaded KV pool)
    flight_recorder: bool = False  # the collective library keeps a flight recorder
    mixed_precision: bool = True  # computes in bf16 under FSDP2 mixed precision (CPU: fp32)
    exact: bool = False  # rl.exact's batch-invariant path has been validated on it


# Accelerator worlds also get gloo for CPU tensors: metrics, ledgers and counters are reduced
# on the host (an NCCL-only group refuses them: "No backend type associated with device type
# cpu", seen on an H200).
DEVICES: dict[str, Capabilities] = {
    "cpu": Capabilities(
        "gloo",
        dispatch_key="CPU",
        memory_stats=False,
        pinned=False,
        mixed_precision=False,
        exact=True,
    ),
    "cuda": Capabilities(  # NVIDIA, and AMD under ROCm (torch.version.hip; RCCL answers "nccl")
        "cpu:gloo,cuda:nccl",
        collective="nccl",
        dispatch_key="CUDA",
        graphs=True,
        triton=True,
        flight_recorder=True,
    ),
    "xpu": Capabilities("cpu:gloo,xpu:xccl", collective="xccl", dispatch_key="XPU", triton=True),
    "npu": Capabilities("cpu:gloo,npu:hccl", collective="hccl"),  # Ascend, torch_npu
    "hpu": Capabilities("cpu:gloo,hpu:hccl", collective="hccl", dispatch_key="HPU"),
    "mps": Capabilities("gloo", dispatch_key="MPS"),
}
GENERIC = Capabilities("gloo", memory_stats=False, pinned=False)  # a type with no row


def capabilities(device: torch.device | str) -> Capabilities:
    """The row of ``device``'s type (`GENERIC` when it has none); a type name works too."""
    kind = device.split(":")[0] if isinstance(device, str) else device.type
    return DEVICES.get(kind, GENERIC)


def register(device_type: str, caps: Capabilities) -> None:
    """Add or replace a device type's row (a port declares what its device can do)."""
    DEVICES[device_type] = caps


def fallback(device: torch.device | str, feature: str, missing: str) -> None:
    """The one log line a feature writes when ``device`` lacks what it needs (once per
    feature and type; none for the CPU, the reference every fallback is)."""
    kind = torch.device(device).type
    if kind != "cpu":
        _warn_once(kind, feature, missing)


@functools.cache
def _warn_once(device_type: str, feature: str, missing: str) -> None:
    log.warning("%s: device %s has no %s; using the fallback", feature, device_type, missing)


# ---- which device ------------------------------------------------------------------------


def accelerator_type() -> str:
    """The accelerator's type torch.accelerator reports, or "cpu" when there is none."""
    if not torch.accelerator.is_available():
        return "cpu"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "cpu"


def device_count() -> int:
    """Accelerators visible to this process (0 without one)."""
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def current_device() -> torch.device:
    """The accelerator this process uses now (its current index), else the CPU."""
    kind = accelerator_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def pick_device(local_rank: int = 0, force_cpu: bool = False) -> torch.device:
    """The accelerator torch.accelerator reports (one per local rank), else CPU."""
    if not force_cpu and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        assert acc is not None
        index = local_rank % max(torch.accelerator.device_count(), 1)
        torch.accelerator.set_device_index(index)
        return torch.device(acc.type, index)
    return torch.device("cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize(device)


def device_name(device: torch.device | str) -> str:
    """A readable name of ``device`` for headers (the GPU's model where the type reports one)."""
    device = torch.device(device)
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(module, "get_device_name"):
        return module.get_device_name(device)
    return device.type


# ---- process groups -----------------------------------------------------------------------


def backend_for(device: torch.device | str) -> str:
    """The process-group backend of ``device``'s type."""
    return capabilities(device).backend


def collective_device(group: Any = None) -> torch.device:
    """Where a small tensor must live for a collective of ``group``: the current accelerator
    when the group's backend is the device's collective library, else the CPU."""
    import torch.distributed as dist

    device = current_device()
    caps = capabilities(device)
    if device.type != "cpu" and caps.collective in str(dist.get_backend(group)):
        return device
    return torch.device("cpu")


# ---- memory -------------------------------------------------------------------------------


def _stats(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type != "cpu" and capabilities(device).memory_stats


def max_memory_allocated(device: torch.device | str) -> int | None:
    """Peak bytes held by tensors on ``device`` since the last reset; None without statistics."""
    return torch.accelerator.max_memory_allocated(device) if _stats(device) else None


def memory_allocated(device: torch.device | str) -> int | None:
    """Bytes held by live tensors on ``device`` now; None without statistics."""
    return torch.accelerator.memory_allocated(device) if _stats(device) else None


def reset_peak_memory_stats(device: torch.device | str) -> None:
    if _stats(device):
        torch.accelerator.reset_peak_memory_stats(device)


def total_memory(device: torch.device | str) -> int | None:
    """The device's memory in bytes (None on the CPU or where the type does not say)."""
    device = torch.device(device)
    if device.type == "cpu" or not capabilities(device).memory_stats:
        return None
    return int(torch.accelerator.get_memory_info(device)[1])


def supports_dtype(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can live on ``device`` (FP8 KV pools ask this); a type
    that does not report its dtypes is taken at its word when the tensor is made."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    try:
        return dtype in torch.accelerator.get_device_capability(device)["supported_dtypes"]
    except (RuntimeError, KeyError, TypeError):
        return True


def pin(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` in page-locked memory when ``device`` copies from it faster that way."""
    return host.pin_memory() if capabilities(device).pinned else host


# ---- random state -------------------------------------------------------------------------


def rng_state() -> tuple[str, Any] | None:
    """(accelerator type, every device's generator state), or None on the CPU."""
    kind = accelerator_type()
    module = getattr(torch, kind, None)
    if kind == "cpu" or not hasattr(module, "get_rng_state_all"):
        return None
    return kind, module.get_rng_state_all()


def set_rng_state(kind: str, state: Any) -> None:
    """Restore what `rng_state` returned, when this process runs on the same device type."""
    module = getattr(torch, kind, None)
    if kind == accelerator_type() and hasattr(module, "set_rng_state_all"):
        module.set_rng_state_all(state)


# ---- kernels ------------------------------------------------------------------------------


@functools.cache
def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_supported(device: torch.device | str) -> bool:
    """Whether Triton kernels compile for ``device`` (its type has a Triton backend and the
    package is installed)."""
    return capabilities(device).triton and triton_installed()


def multiprocessor_count(device: torch.device | str) -> int:
    """Streaming multiprocessors (compute units) of ``device``: the kernels' grid sizing."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return _multiprocessors(device.type, index)


@functools.cache
def _multiprocessors(kind: str, index: int) -> int:
    return getattr(torch, kind).get_device_properties(index).multi_processor_count


def compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA device (Hopper is 9.0); None for other types and under ROCm,
    whose "cuda" devices answer with their gfx version (an MI300 says 9.4)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


def dispatch_keys() -> tuple[str, ...]:
    """aten dispatch keys of the CPU and this process's accelerator (rl.exact registers its
    batch-invariant matmuls on each)."""
    kind = accelerator_type()
    return ("CPU",) if kind == "cpu" else ("CPU", capabilities(kind).dispatch_key)


# ---- graphs -------------------------------------------------------------------------------


def capture(
    device: torch.device | str, run: Callable[[], Any], pool: Any = None
) -> tuple[Any, Any, Any]:
    """Warm ``run`` up on a side stream, then capture it as one graph sharing ``pool``.

    Returns (graph, what run returned during the capture, the graph's pool); ``graph.replay()``
    reruns it on the same buffers. Only types whose row says ``graphs`` get here."""
    if not capabilities(device).graphs or torch.device(device).type != "cuda":
        raise RuntimeError(f"device {torch.device(device).type}: no graph capture")
    with _side_stream():
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool()


@contextlib.contextmanager
def _side_stream() -> Iterator[None]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        yield
    torch.cuda.current_stream().wait_stream(s)
