"""The Triton kernels over low-bit weights (tandem/kernels/triton_weight_quant.py) against the
PyTorch reference, under the interpreter without CUDA: the decode equals `dequantize` bit for
bit for every format and ragged shapes (partial blocks, an odd input count for w4a16), and the
product equals ``F.linear(x, dequantize(q))`` to float tolerance (another summation order).
As in test_fp8_kv.py, the file reruns itself in a clean subprocess when triton was imported
before ``TRITON_INTERPRET`` was set."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tandem.kernels import weight_quant as wq  # noqa: E402
from tests.kernels.interpreted import interpreter_guard  # noqa: E402

_needs_usable_triton, test_all_in_clean_subprocess = interpreter_guard(__file__)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(40, 48), (130, 33), (7, 160)]


@pytest.mark.parametrize("name", list(wq.FORMATS))
def test_triton_decode_is_the_reference_bit_for_bit(name: str) -> None:
    from tandem.kernels.triton_weight_quant import dequantize_triton

    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * torch.logspace(-4, 1, k)).to(DEVICE)
        q = wq.quantize(w, name)
        assert torch.equal(dequantize_triton(wq.kernel_operands(q)), wq.dequantize(q)), (name, n, k)


@pytest.mark.parametrize("name", list(wq.FORMATS))
def test_triton_linear_matches_the_reference(name: str) -> None:
    from tandem.kernels.triton_weight_quant import quant_linear_triton, use_quant_linear_kernel

    assert use_quant_linear_kernel(torch.ones(1, device=DEVICE), "triton")
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
        x = torch.randn(3, 5, k, generator=g).to(DEVICE)
        b = torch.randn(n, generator=g).to(DEVICE)
        q = wq.quantize(w, name)
        want = F.linear(x, wq.dequantize(q), b)
        got = quant_linear_triton(x, wq.kernel_operands(q), b)
        assert got.shape == want.shape == (3, 5, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_quant_linear_forced() -> None:
    """`QuantLinear` runs the kernel under advanced.kernels = "triton", the reference otherwise."""
    from tandem.kernels.dispatch import set_kernels

    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(24, 32, generator=g).to(DEVICE), torch.randn(4, 32, generator=g).to(DEVICE)
    lin = wq.QuantLinear.of("w4a16", w, None)
    ref = lin(x)
    assert torch.equal(ref, F.linear(x, wq.fake_quant(w, "w4a16")))
    set_kernels("triton")
    try:
        got = lin(x)
    finally:
        set_kernels(None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
