"""The fused LoRA projection (tandem/kernels/lora_linear.py) against its PyTorch form, forward and
gradients, and `LoraLinear` taking it only where Triton is forced (under the interpreter on CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tandem.kernels.lora_linear import lora_linear, lora_linear_ref, use_fused_lora  # noqa: E402
from tandem.models.lora import LoraLinear  # noqa: E402
from tests.kernels.interpreted import interpreter_guard  # noqa: E402

_needs_usable_triton, test_all_in_clean_subprocess = interpreter_guard(__file__)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(m: int, n: int, k: int, r: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(*s, generator=g) * 0.3 for s in ((2, m, k), (n, k), (n,), (r, k), (n, r))]
    return (
        [x.to(DEV).requires_grad_() for x in t[:2]]
        + [t[2].to(DEV).requires_grad_() if bias else None]
        + [x.to(DEV).requires_grad_() for x in t[3:]]
    )


@pytest.mark.parametrize(
    "m,n,k,r,bias", [(7, 40, 24, 4, True), (33, 70, 50, 16, False), (1, 16, 16, 3, True)]
)
def test_triton_lora_linear_equals_the_torch_form(m, n, k, r, bias):
    x, w, b0, a, b = _inputs(m, n, k, r, bias)
    want = lora_linear_ref(x, w, b0, a, b, 0.7)
    got = lora_linear(x, w, b0, a, b, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    params = [t for t in (x, w, b0, a, b) if t is not None]
    ref_grads = torch.autograd.grad(want, params, g)
    got_grads = torch.autograd.grad(got, params, g)
    for name, rg, gg in zip("x w bias a b".split(), ref_grads, got_grads):
        torch.testing.assert_close(gg, rg, rtol=1e-5, atol=1e-5, msg=name)


def test_triton_only_where_forced(kernels):
    base = torch.nn.Linear(24, 40, device=DEV)
    layer = LoraLinear(base, rank=4, scale=2.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 5, 24, device=DEV)
    kernels(None)
    assert not use_fused_lora(x)
    plain = layer(x)
    kernels("triton")
    assert use_fused_lora(x)
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    layer.lora_enabled = False
    torch.testing.assert_close(layer(x), base(x))
