"""An exact, order-free checksum of named tensors held as boxes on many ranks.

``sum over elements of bits(x) * w(name, flat index)  (mod 2**32)``, where ``bits`` is the
element's bit pattern as an unsigned integer and ``w`` an odd weight below 2**31 mixed from
the tensor's name and the element's index in the *global* tensor. Integer sums are
associative, so the sum over any tiling of a tensor into boxes, computed on any ranks in any
order, is the same number; a change to any single bit of any element changes it (the change
is ``2**j * w`` with ``w`` odd and ``j < 32``, never a multiple of 2**32), and a change to two
elements cancels only if their weights happen to line up. Every step is an int64 multiply,
add or mask (no division), each product below 2**63. Used to check that what a generation
copy runs equals what the trainer holds (tandem/parallel/reshard.py).
"""

from __future__ import annotations

import zlib

import torch

MOD = 1 << 32  # checksums are ints in [0, MOD)
_MASK31, _MASK32 = (1 << 31) - 1, MOD - 1
_MIX = 0x9E3779B1  # < 2**32: index * _MIX < 2**63 for tensors below 2**31 elements
_BITS = {4: (torch.int32, 0xFFFFFFFF), 2: (torch.int16, 0xFFFF)}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as non-negative int64 (fp32 / bf16 / fp16 tensors)."""
    view, mask = _BITS[x.element_size()]
    return x.contiguous().view(view).long() & mask


def box_checksum(
    name: str, data: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]
) -> int:
    """The checksum of ``data``, the region of global tensor ``name`` (of ``shape``) that starts at
    ``offset`` (``data.shape`` its size); an int in [0, MOD)."""
    if data.numel() == 0:
        return 0
    # the name's salt
    index = torch.full((), zlib.crc32(name.encode()), dtype=torch.long, device=data.device)
    stride = 1
    for d in reversed(range(len(shape))):
        # + the global flat index of every element, by broadcasting
        pos = torch.arange(offset[d], offset[d] + data.shape[d], device=data.device).view(
            [-1 if i == d else 1 for i in range(len(shape))]
        )
        index = index + pos * stride
        stride *= shape[d]
    w = ((index * _MIX) & _MASK31) | 1  # [*data.shape], odd, < 2**31
    # each product < 2**63; deliberate host sync
    return int(((_bits(data) * w) & _MASK32).sum().item() % MOD)
