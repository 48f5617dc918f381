"""``rl.exact`` on the Triton path: the batch-invariant Triton matmul against torch, its
invariance to the batch, exact mode routing ``nn.Linear`` to it; the fused exact attention
against `attention_torch`, its invariance, dispatch and gradients; and the reductions without
a Triton form (tree logsumexp, RMSNorm, `attention_torch`) checked for invariance on the device.

Without CUDA the kernel runs under the interpreter; as in test_grouped_gemm.py, if triton
was imported before ``TRITON_INTERPRET`` was set, the in-process Triton tests are skipped
and `test_all_in_clean_subprocess` runs this file in a fresh interpreter. On CUDA the same
tests check the GPU (scripts/gpu_check.sh, part ``exact``): there the matmul is ``tl.dot``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from tandem.kernels import batch_invariant as bi  # noqa: E402
from tandem.kernels.dispatch import triton_available  # noqa: E402
from tandem.models.transformer import RMSNorm  # noqa: E402
from tests.kernels.interpreted import ROOT, interpreter_guard  # noqa: E402

_needs_usable_triton, test_all_in_clean_subprocess = interpreter_guard(__file__)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEIGHBOURS = (1, 7, 63)


def _tk():  # noqa: ANN202 - module object
    from tandem.kernels import triton_batch_invariant

    return triton_batch_invariant


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _batch_around(row: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, int]:
    """``row [1, ...]`` at position k // 2 among ``k`` random neighbours: ``([k + 1, ...],
    position)``."""
    others = _randn(k, *row.shape[1:], seed=seed, dtype=row.dtype) * 3
    return torch.cat([others[: k // 2], row, others[k // 2 :]]), k // 2


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the dtype's rounding of the fp64 result: bf16 allows a whole ulp (2**-7 relative),
    as the interpreter rounds fp32 to bf16 by truncation (34.2459 gave 34.0, not 34.25)."""
    atol, rtol = {
        torch.float32: (1e-4, 1e-5),
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (2e-2, 2**-7),
    }[got.dtype]
    assert ((got.double() - want).abs() <= atol + rtol * want.abs()).all(), (
        (got.double() - want).abs().max()
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matmul_matches_torch(dtype):
    """``x @ w.T (+ b)`` with ragged M, N, K (none a multiple of a tile), the linear layout
    (``w.T`` a transposed view) and a contiguous ``b``, against fp64 torch."""
    tk = _tk()
    x, w, b = (
        _randn(70, 100, seed=0, dtype=dtype),
        _randn(90, 100, seed=1, dtype=dtype),
        _randn(90, seed=2, dtype=dtype),
    )
    ref = x.double() @ w.double().T
    got = tk.matmul(x, w.T)
    assert got.dtype == dtype and got.shape == (70, 90)
    _close(got, ref)
    _close(tk.matmul(x, w.T.contiguous(), b, alpha=0.5, beta=2.0), 0.5 * ref + 2.0 * b.double())
    full_bias = _randn(70, 90, seed=3, dtype=dtype)  # addmm's [M, N] self
    _close(tk.matmul(x, w.T, full_bias), ref + full_bias.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matmul_rows_do_not_depend_on_the_batch(dtype):
    """Each of 70 rows computed alone equals its row of the 70-row product, and one row alone
    equals itself among 1, 7 and 63 random neighbours (a different position in its tile
    each time): identical bits."""
    tk = _tk()
    x, w, b = (
        _randn(70, 100, seed=4, dtype=dtype),
        _randn(130, 100, seed=5, dtype=dtype),
        _randn(130, seed=6, dtype=dtype),
    )
    batched = tk.matmul(x, w.T, b)
    alone = torch.cat([tk.matmul(x[i : i + 1], w.T, b) for i in range(70)])
    assert torch.equal(alone, batched)
    target = _randn(1, 100, seed=7, dtype=dtype)
    ref = tk.matmul(target, w.T, b)
    for k in NEIGHBOURS:
        batch, at = _batch_around(target, k, seed=10 + k)
        assert torch.equal(tk.matmul(batch, w.T, b)[at : at + 1], ref), k


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_triton_exact_mode_routes_linear_by_dispatch(monkeypatch, kernels, impl):
    """With exact mode on, ``nn.Linear`` (aten addmm / mm) goes to the Triton matmul when
    `tandem.kernels.dispatch` says Triton and to `tiled_mm` otherwise; gradients stay correct."""
    tk = _tk()
    kernels(impl)
    calls = []
    real = tk.matmul
    monkeypatch.setattr(tk, "matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lin = torch.nn.Linear(100, 40).to(DEVICE)
    x = _randn(9, 3, 100, seed=8).requires_grad_()
    want = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    with bi.exact_mode():
        y = lin(x)
        one = lin(x[:1, :1])
        y.square().sum().backward()
    assert not bi.enabled()
    assert (len(calls) > 0) == (impl == "triton")
    assert torch.equal(y[:1, :1], one)
    if impl == "triton":  # the very kernel, bit for bit
        assert torch.equal(
            y.reshape(27, 40), real(x.detach().reshape(27, 100), lin.weight.T, lin.bias)
        )
    assert (y.double() - want).abs().max().item() <= 1e-4
    gx, gw = torch.autograd.grad(want.square().sum(), (x, lin.weight))
    torch.testing.assert_close(x.grad, gx.float(), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(lin.weight.grad, gw.float(), atol=1e-3, rtol=1e-4)


# ---- the reductions without a Triton form: invariant by construction on any device ---------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reductions_rows_do_not_depend_on_the_batch(dtype):
    """Tree logsumexp over a 151936-wide vocabulary, RMSNorm and `attention_torch`: one row
    alone and among 1, 7 and 63 neighbours, on this device (CUDA in scripts/gpu_check.sh)."""
    z = _randn(1, 151936, seed=20) * 4
    norm = RMSNorm(2048, 1e-6).to(DEVICE, dtype)
    norm.weight.data = _randn(2048, seed=21, dtype=dtype)
    h = _randn(1, 2048, seed=22, dtype=dtype)
    lse, normed = bi.logsumexp(z), norm(h)
    torch.testing.assert_close(lse, torch.logsumexp(z.double(), -1).float())
    for k in NEIGHBOURS:
        batch, at = _batch_around(z, k, seed=30 + k)
        assert torch.equal(bi.logsumexp(batch)[at : at + 1], lse), k
        batch, at = _batch_around(h, k, seed=40 + k)
        assert torch.equal(norm(batch)[at : at + 1], normed), k
    q, kv = _randn(1, 4, 64, seed=50, dtype=dtype), _randn(300, 2, 64, seed=51, dtype=dtype)
    index = torch.arange(257, device=DEVICE)[None]  # the query over keys 0..256
    one = bi.attention_torch(q, kv, kv * 0.5, index, torch.tensor([257], device=DEVICE), 0.125)
    for k in NEIGHBOURS:  # neighbours with shorter and longer contexts
        qs, at = _batch_around(q, k, seed=60 + k)
        lens = torch.randint(1, 300, (k + 1,), generator=torch.Generator().manual_seed(k)).to(
            DEVICE
        )
        lens[at] = 257
        idx = torch.arange(300, device=DEVICE).expand(k + 1, 300)
        out = bi.attention_torch(qs, kv, kv * 0.5, idx, lens, 0.125)
        assert torch.equal(out[at : at + 1], one), k


def _attention_problem(t: int, length: int, dtype: torch.dtype, seed: int):
    q = _randn(t, 4, 24, seed=seed, dtype=dtype)  # D = 24: padded to 32 inside
    k, v = (
        _randn(length, 2, 24, seed=seed + 1, dtype=dtype),
        _randn(length, 2, 24, seed=seed + 2, dtype=dtype),
    )
    lens = torch.randint(1, length + 1, (t,), generator=torch.Generator().manual_seed(seed)).to(
        DEVICE
    )
    perm = torch.stack(
        [
            torch.randperm(length, generator=torch.Generator().manual_seed(seed + i))
            for i in range(t)
        ]
    )
    return q, k, v, perm.to(DEVICE), lens  # each query's keys: a random order of the store's rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_matches_the_reference_and_is_invariant(dtype):
    """The fused kernel against `attention_torch` (close: exp differs in the last bit), and
    bitwise: each query alone (its own keys only) equals itself in the batch, where the key
    index is wider, and with other chunk sizes; lengths cover one chunk, a partial chunk and
    many chunks (the counter)."""
    tk = _tk()
    q, k, v, index, lens = _attention_problem(9, 300, dtype, seed=70)
    lens[:3] = torch.tensor([1, 64, 300])
    got = tk.attention(q, k, v, index, lens, 0.2)
    # its fp32 math, unrounded
    want = bi.attention_torch(q.float(), k.float(), v.float(), index, lens, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i in range(9):
        n = int(lens[i])
        one = tk.attention(q[i : i + 1], k, v, index[i : i + 1, :n], lens[i : i + 1], 0.2)
        assert torch.equal(one, got[i : i + 1]), i
    for chunk in (16, 64):
        # other chunkings of the same tree (deeper or shallower counters): same bits
        assert torch.equal(tk.attention(q, k, v, index, lens, 0.2, chunk=chunk), got), chunk


def test_triton_attention_dispatch_and_gradients(monkeypatch, kernels):
    """`batch_invariant.attention` takes the kernel under advanced.kernels = triton (bitwise its
    output) and gives the reference's gradients (backward recomputes through it)."""
    tk = _tk()
    kernels("triton")
    q, k, v, index, lens = _attention_problem(6, 70, torch.float32, seed=80)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = bi.attention(*leaves, index, lens, 0.3)
    assert torch.equal(out, tk.attention(q, k, v, index, lens, 0.3))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = bi.attention_torch(*ref_leaves, index, lens, 0.3)
    dy = _randn(*out.shape, seed=81)
    for got, want in zip(
        torch.autograd.grad(out, leaves, dy), torch.autograd.grad(ref, ref_leaves, dy), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert bi.attention(q[:0], k, v, index[:0], lens[:0], 0.3).shape == (0, 4, 24)


def test_kernels_compile_for_a_gpu() -> None:
    """The kernels through Triton's compiler and ptxas for sm_90 (tests/kernels/compile_check.py),
    in a process without the interpreter; skipped where Triton lacks its CUDA backend."""
    if not triton_available() or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernels" / "compile_check.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 2 * len(DTYPES) + 2
