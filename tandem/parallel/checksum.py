"""An exact, order-free checksum of named tensors held as boxes on many ranks.

``sum over elements of bits(x) * w(name, flat index)  (mod P)``, P = 2**31 - 1 (prime), where
``bits`` is the element's bit pattern as an unsigned integer and ``w`` a weight in
``[1, P - 1]`` mixed from the tensor's name and the element's index in the *global* tensor.
Integer sums are associative, so the sum over any tiling of a tensor into boxes, computed
on any ranks in any order, is the same number; a change to any single element changes it
(``bits`` changes by a nonzero amount below 2**32 and ``w`` is invertible mod P). Used to
check that what a generation copy runs equals what the trainer holds (tandem/parallel/reshard.py).
"""

from __future__ import annotations

import zlib

import torch

P = (1 << 31) - 1
_MIX = 0x9E3779B1 % P  # a multiplier that spreads neighbouring indices over [0, P)
_BITS = {4: (torch.int32, 0xFFFFFFFF), 2: (torch.int16, 0xFFFF)}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as non-negative int64 (fp32 / bf16 / fp16 tensors)."""
    view, mask = _BITS[x.element_size()]
    return x.contiguous().view(view).long() & mask


def box_checksum(name: str, data: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The checksum of ``data``, the region of global tensor ``name`` (of ``shape``) that starts at
    ``offset`` (``data.shape`` its size); an int in [0, P)."""
    if data.numel() == 0:
        return 0
    index = torch.zeros((), dtype=torch.long, device=data.device)
    stride = 1
    for d in reversed(range(len(shape))):  # the global flat index of every element, by broadcasting
        pos = torch.arange(offset[d], offset[d] + data.shape[d], device=data.device).view(
            [-1 if i == d else 1 for i in range(len(shape))])
        index = index + pos * stride
        stride *= shape[d]
    salt = zlib.crc32(name.encode()) % P
    w = ((index % P) * _MIX + salt) % (P - 1) + 1  # [*data.shape] in [1, P - 1]
    return int(((_bits(data) * w) % P).sum().item() % P)  # each product < 2**63; deliberate host sync
