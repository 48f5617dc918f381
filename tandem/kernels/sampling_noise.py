"""The sampler's counter-based Exp(1) noise in one Triton pass (CUDA), for measurement.

`tandem.rl.generator.sampler.exponential_noise` defines the noise: for row key words
``(k0, k1)`` and vocabulary id ``t``, ``h = mix32(mix32((t + k0) mod 2**32) ^ k1)``,
``u = ((h >> 9) + 0.5) * 2**-23`` and ``E = -log(u)``. Its PyTorch form runs 30
elementwise passes over ``[N, V]``, 24 of them in int64 (at 64 rows of a
151,936-token vocabulary, 78 MB each), outside the decode step's CUDA graph. This kernel
computes each element in registers and writes the fp32 result once.

The hash is unsigned 32-bit arithmetic, so its wrap-around is defined and equal to
the PyTorch form's masked int64 products; the integer part is bit-identical, and
``E`` is equal up to the last bit of the device's ``log``.

It is not used by default yet: nothing here was timed on a GPU. The sampler takes
it under ``advanced.kernels = "triton"`` (or ``impl="triton"``), so both forms can
be timed on one workload: ``python -m bench.sampler_noise`` for the noise alone,
``python -m bench.grpo_step --engines tandem,tandem-triton ...`` for a whole step (the
other kernels are Triton on CUDA either way).
"""

from __future__ import annotations

import torch

from tandem import device as seam
from tandem.kernels.dispatch import requested_impl, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch form needs no Triton
    triton = None

__all__ = ["noise_in_one_pass", "use_one_pass_noise"]


def use_one_pass_noise(t: torch.Tensor, impl: str | None = None) -> bool:
    """Whether `noise_in_one_pass` serves tensors like ``t``: only where Triton is forced
    (`tandem.kernels.dispatch.requested_impl`), as it is untimed; raises like `use_triton` where
    forced Triton cannot run."""
    forced = requested_impl(impl)
    return forced == "triton" and use_triton(t, forced)


def noise_in_one_pass(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[N, V]`` fp32 from row key words ``[N, 2]`` int64 (each in ``[0, 2**32)``)."""
    n = words.shape[0]
    out = torch.empty(n, vocab_size, dtype=torch.float32, device=words.device)
    if n == 0 or vocab_size == 0:
        return out
    block = 1024 if seam.triton_supported(words.device) else 64
    _noise_kernel[(n, triton.cdiv(vocab_size, block))](
        words.contiguous(), out, vocab_size, BLOCK=block
    )
    return out


if triton is not None:

    @triton.jit
    def _mix32(x):
        """The 'lowbias32' bijection on uint32 (see `tandem.rl.generator.sampler._mix32_`)."""
        x ^= x >> 16
        x = x * 0x7FEB352D
        x ^= x >> 15
        x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
        x ^= x >> 16
        return x

    @triton.jit
    def _noise_kernel(words_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        k0 = tl.load(words_ptr + 2 * row).to(tl.uint32)
        k1 = tl.load(words_ptr + 2 * row + 1).to(tl.uint32)
        h = _mix32(cols.to(tl.uint32) + k0)  # the sum wraps modulo 2**32
        h = _mix32(h ^ k1)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact, inside (0, 1)
        tl.store(out_ptr + row * V + cols, -tl.log(u), mask=cols < V)
