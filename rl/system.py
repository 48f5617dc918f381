"""Host and device facts for metrics: peak memory, resident memory."""

from __future__ import annotations

import resource

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory allocated (GB); on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
