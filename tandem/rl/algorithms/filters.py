"""Sample filters and length shaping from DAPO (arXiv 2503.14476).

- `filter_groups`: dynamic sampling. A group whose responses all got the same
  reward has zero group-relative advantage and contributes no gradient; DAPO
  drops such groups and keeps sampling until the batch is full. This returns the
  keep mask; refilling the batch is the caller's job. Reading the mask on the
  host (to select rows) is the caller's deliberate sync.
- `overlong_penalty`: soft overlong punishment, added to the reward.
- `overlong_filter_mask`: overlong filtering, masks truncated samples out of the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["filter_groups", "overlong_filter_mask", "overlong_penalty"]


def filter_groups(scores: Tensor, group_index: Tensor, atol: float = 0.0) -> Tensor:
    """Keep mask ``[N]`` bool: False for every member of a group whose scores are all equal.

    scores: ``[N]``; group_index: ``[N]`` long, dense ids in ``[0, N)``.
    Equal means ``max - min <= atol`` within the group (exact by default).
    A group of one is dropped (its advantage is 0 under any group baseline).
    """
    n = scores.shape[0]
    g = group_index.long()
    x = scores.float()
    hi = torch.full((n,), float("-inf"), device=x.device).scatter_reduce(0, g, x, "amax")  # [N]
    lo = torch.full((n,), float("inf"), device=x.device).scatter_reduce(0, g, x, "amin")  # [N]
    return (hi - lo)[g] > atol


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment ``[N]``, to add to the sequence reward.

    0 for ``len <= max_len - buffer_len``, falling linearly to ``-factor`` at
    ``len = max_len``, and ``-factor`` beyond. DAPO's formula is the case factor = 1.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer_len <= max_len, got {buffer_len}, {max_len}"
        )
    over = (lengths.float() - (max_len - buffer_len)) / buffer_len  # [N]
    return -factor * over.clamp(0.0, 1.0)


def overlong_filter_mask(truncated: Tensor) -> Tensor:
    """``[N]`` float: 0 for truncated samples (hit the length limit), 1 otherwise.

    Multiply into the loss mask (``mask * keep[:, None]``); a fully masked
    sequence is then also left out of the sequence counts of `make_norm`.
    """
    return (~truncated.bool()).float()
