"""Host and device facts for metrics (peak memory, resident memory) and host allocator tuning."""

from __future__ import annotations

import ctypes
import os
import resource

import torch

from tandem import device as seam


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory allocated (GB); on CPU the process's peak RSS."""
    peak = seam.max_memory_allocated(device)
    if peak is not None:
        return peak / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def allocated_gb(device: torch.device) -> float | None:
    """Device memory held by live tensors now (GB); None without allocator statistics (CPU)."""
    held = seam.memory_allocated(device)
    return None if held is None else held / 1e9


def reset_peak_memory(device: torch.device) -> None:
    seam.reset_peak_memory_stats(device)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_host_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep CPU tensors of up to ``mmap_threshold`` bytes on glibc's heap.

    By default glibc serves allocations above a dynamic threshold (128 KiB at
    start) with fresh ``mmap`` pages and unmaps them on free, so a loop that
    allocates MB-sized temporaries (CPU attention, log-prob chunks) can page-fault
    on every call: the CPU paged-attention page gather and copy took 0.14 ms or
    2.5 ms per call from one process start to the next. A fixed threshold (and a
    high trim threshold, so freed heap memory is reused rather than returned)
    removes that. Environment settings ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` win. Returns whether the settings were applied
    (False off glibc).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        return False
