"""tandem/kernels/cpu_linear.py: oneDNN linears against F.linear and a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem.kernels.cpu_linear as cl

pytestmark = pytest.mark.skipif(
    not cl.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear"
)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach oneDNN."""
    seen = []
    real = cl._onednn

    def counting(x, w, b):
        seen.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(cl, "_onednn", counting)
    return seen


def _inputs():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(32, 256, generator=g)  # a decode step's rows
    yield torch.randn(2, 7, 256, generator=g)  # [B, S, D]
    yield torch.randn(256, 9, generator=g).t()  # not contiguous
    yield torch.randn(1, 5, 512, generator=g)[..., ::2]  # strided last dim
    yield torch.randn(0, 256)  # an empty step


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(calls, bias, pack):
    torch.manual_seed(1)
    lin = nn.Linear(256, 96, bias=bias)
    ref = nn.Linear(256, 96, bias=bias)
    ref.load_state_dict(lin.state_dict())
    assert cl.use_onednn_linears(lin, pack=pack) == 1 and type(lin) is cl.OneDNNLinear
    assert (lin.packed is not None) == pack
    with torch.no_grad():
        for x in _inputs():
            got, expected = lin(x), ref(x)
            exact = F.linear(
                x.double(), ref.weight.double(), None if ref.bias is None else ref.bias.double()
            )
            assert got.shape == expected.shape and got.dtype == torch.float32
            # as close to the float64 result as MKL's own fp32 answer is (a few ulps of K=256 sums)
            assert _err(got, exact) <= max(2 * _err(expected, exact), 1e-5)
    assert len(calls) == 5


def test_onednn_linear_leaves_autograd_and_other_dtypes_to_f_linear(calls):
    torch.manual_seed(2)
    lin, ref = nn.Linear(64, 48), nn.Linear(64, 48)
    ref.load_state_dict(lin.state_dict())
    cl.use_onednn_linears(lin)
    x = torch.randn(5, 64, requires_grad=True)
    lin(x).square().sum().backward()  # weight needs a gradient: F.linear, bit for bit
    xr = x.detach().clone().requires_grad_(True)
    ref(xr).square().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(x.grad, xr.grad)
    with torch.no_grad():
        assert torch.equal(lin.to(torch.float64)(x.double()), ref.to(torch.float64)(x.double()))
    assert calls == []
    lin.float().requires_grad_(False)
    y = lin(x)  # input needs a gradient: still F.linear
    assert y.requires_grad and calls == []
    lin(x.detach())  # nothing needs one: oneDNN
    assert calls == [(5, 64)]


def test_packed_weight_follows_in_place_changes(calls):
    """A weight changed in place after packing is used as it now is, not as packed."""
    torch.manual_seed(3)
    lin = nn.Linear(32, 16, bias=False).requires_grad_(False)
    cl.use_onednn_linears(lin)
    x = torch.randn(4, 32)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=0)
    lin.weight.mul_(-2.0)  # e.g. a weight refresh into the same tensor
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=0)
    lin.pack()
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=0)
    assert len(calls) == 3


def test_use_onednn_linears_converts_plain_linears_only():
    class Head(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Head(4, 4), nn.Sequential(nn.Linear(4, 2)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert cl.use_onednn_linears(model) == 2
    assert [type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)] == [
        "OneDNNLinear",
        "Head",
        "OneDNNLinear",
    ]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
