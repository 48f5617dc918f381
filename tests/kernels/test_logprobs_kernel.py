"""Chunked / Triton per-token log-probs and entropy vs the naive full-logits reference.

Without CUDA the Triton kernels run under the interpreter (``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` before triton is imported); shapes are tiny so that
stays fast. The interpreter computes ``tl.dot`` on bf16 wrongly, so Triton bf16
runs on CUDA only (fp16 covers the half-precision path on CPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.dispatch import triton_available, triton_interpreting
from tandem.kernels.logprobs import token_logprobs_entropy, token_logprobs_entropy_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = triton_available() and (torch.cuda.is_available() or triton_interpreting())
IMPLS = [
    "torch",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not TRITON_OK, reason="Triton cannot run here")
    ),
]
HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _inputs(
    T: int, V: int, D: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g) * 0.7  # logits of O(few): peaked and flat rows
    w = torch.randn(V, D, generator=g) * 0.7
    tgt = torch.randint(0, V, (T,), generator=g)
    return (
        h.to(DEVICE, dtype).requires_grad_(),
        w.to(DEVICE, dtype).requires_grad_(),
        tgt.to(DEVICE),
    )


def _run(fn, h, w, tgt, a, b, **kw):  # noqa: ANN001, ANN202
    """Values and (grad_h, grad_w) of ``sum(a * logp + b * entropy)``."""
    logp, ent = fn(h, w, tgt, **kw)
    loss = (a * logp).sum() + ((b * ent).sum() if ent is not None else 0.0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return logp, ent, gh, gw


def _coefs(T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, generator=g).to(DEVICE), torch.randn(T, generator=g).to(DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("T", "V", "D", "chunk"), [(37, 101, 32, 8), (37, 257, 24, 16), (5, 101, 16, 1024)]
)
def test_matches_reference_fp32(impl: str, T: int, V: int, D: int, chunk: int) -> None:
    h, w, tgt = _inputs(T, V, D)
    a, b = _coefs(T)
    ref = _run(token_logprobs_entropy_reference, h, w, tgt, a, b)
    out = _run(token_logprobs_entropy, h, w, tgt, a, b, impl=impl, chunk_tokens=chunk)
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_without_entropy(impl: str) -> None:
    h, w, tgt = _inputs(37, 101, 16)
    a, _ = _coefs(37)
    logp, ent, gh, gw = _run(
        token_logprobs_entropy, h, w, tgt, a, None, impl=impl, with_entropy=False, chunk_tokens=10
    )
    assert ent is None
    ref_logp, ref_ent, ref_gh, ref_gw = _run(
        token_logprobs_entropy_reference, h, w, tgt, a, None, with_entropy=False
    )
    for name, x, y in zip(
        ("logp", "grad_hidden", "grad_weight"), (logp, gh, gw), (ref_logp, ref_gh, ref_gw)
    ):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_entropy_unused_and_frozen_weight(impl: str) -> None:
    """Only logp in the loss (entropy grad arrives as zeros); weight needs no grad."""
    h, w, tgt = _inputs(37, 101, 16)
    w = w.detach()
    logp, _ = token_logprobs_entropy(h, w, tgt, impl=impl, chunk_tokens=7)
    (gh,) = torch.autograd.grad(logp.sum(), (h,))
    ref_logp, _ = token_logprobs_entropy_reference(h, w, tgt)
    (ref_gh,) = torch.autograd.grad(ref_logp.sum(), (h,))
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(impl: str) -> None:
    """An empty micro-batch (ranks pad with them to stay in step) gives empty values and zero
    gradients of the inputs' shapes and dtypes."""
    h, w, tgt = _inputs(0, 101, 16)
    logp, ent, gh, gw = _run(token_logprobs_entropy, h, w, tgt, 1.0, 1.0, impl=impl, chunk_tokens=8)
    assert logp.shape == ent.shape == (0,)
    assert gh.shape == (0, 16) and gw.shape == w.shape and gw.dtype == w.dtype
    assert not gw.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision(impl: str, dtype: torch.dtype) -> None:
    """fp32 softmax math on half inputs; grads come back in the input dtype."""
    h, w, tgt = _inputs(37, 101, 32, dtype)
    a, b = _coefs(37)
    out = _run(token_logprobs_entropy, h, w, tgt, a, b, impl=impl, chunk_tokens=8)
    ref = _run(token_logprobs_entropy_reference, h, w, tgt, a, b)
    assert out[0].dtype == out[1].dtype == torch.float32
    assert out[2].dtype == out[3].dtype == dtype
    # The reference rounds logits to the half dtype before upcasting; Triton does not.
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.skipif(not TRITON_OK, reason="Triton cannot run here")
@pytest.mark.parametrize("nsplit", [1, 3, 9])
def test_triton_vocab_splits_merge_exactly(monkeypatch: pytest.MonkeyPatch, nsplit: int) -> None:
    """The forward's per-split sums merge to the reference for any split count, including
    splits left empty (9 splits of whole 16-wide tiles over V=101 leave the last two empty)."""
    import tandem.kernels.logprobs as lp

    monkeypatch.setattr(lp, "_num_splits", lambda *args: nsplit)
    h, w, tgt = _inputs(37, 101, 16)
    a, b = _coefs(37)
    out = _run(token_logprobs_entropy, h, w, tgt, a, b, impl="triton", chunk_tokens=16)
    ref = _run(token_logprobs_entropy_reference, h, w, tgt, a, b)
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_half_precision_one_chunk(impl: str) -> None:
    """All tokens in one chunk: the Triton backward writes grad_weight in the input dtype
    directly, with no fp32 accumulator."""
    h, w, tgt = _inputs(37, 101, 32, torch.float16)
    a, b = _coefs(37)
    out = _run(token_logprobs_entropy, h, w, tgt, a, b, impl=impl, chunk_tokens=64)
    ref = _run(token_logprobs_entropy_reference, h, w, tgt, a, b)
    assert out[3].dtype == torch.float16
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2, msg=name)


def test_bf16_torch_path() -> None:
    h, w, tgt = _inputs(37, 101, 32, torch.bfloat16)
    a, b = _coefs(37)
    out = _run(token_logprobs_entropy, h, w, tgt, a, b, impl="torch", chunk_tokens=8)
    ref = _run(token_logprobs_entropy_reference, h, w, tgt, a, b)
    assert out[2].dtype == out[3].dtype == torch.bfloat16
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        torch.testing.assert_close(x.float(), y.float(), atol=5e-2, rtol=5e-2, msg=name)


def test_gradcheck_torch_path() -> None:
    """Checks the backward formulas for both outputs against finite differences (fp64)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(11, 5, generator=g, dtype=torch.float64).requires_grad_()
    tgt = torch.randint(0, 11, (7,), generator=g)

    def f(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_entropy(h, w, tgt, impl="torch", chunk_tokens=3)

    assert torch.autograd.gradcheck(f, (h, w))


def test_bad_impl_raises() -> None:
    h, w, tgt = _inputs(4, 16, 16)
    with pytest.raises(ValueError, match="bogus"):
        token_logprobs_entropy(h, w, tgt, impl="bogus")


def test_bad_shapes_raise() -> None:
    h, w, tgt = _inputs(4, 16, 16)
    with pytest.raises(ValueError, match="weight"):
        token_logprobs_entropy(h, w[:, :8], tgt, impl="torch")
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_entropy(h, w, tgt[:3], impl="torch")


def _saved_bytes(fn, *args, **kw) -> int:  # noqa: ANN001
    """Bytes of distinct storages autograd saves for backward during ``fn(*args)``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = fn(*args, **kw)
    (logp.sum() + ent.sum()).backward()  # and the graph is usable
    return sum(storages.values())


def test_saves_no_logits() -> None:
    """The chunked path saves < 1/4 of one [T, V] fp32 tensor; the naive one saves more than one."""
    T, V, D = 512, 8192, 64
    full = T * V * 4
    h, w, tgt = _inputs(T, V, D)
    chunked = _saved_bytes(token_logprobs_entropy, h, w, tgt, impl="torch", chunk_tokens=64)
    naive = _saved_bytes(token_logprobs_entropy_reference, h, w, tgt)
    assert chunked < full / 4, (chunked, full)
    assert naive >= full, (naive, full)


def test_unforced_calls_take_triton_on_cuda_and_the_chunked_path_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
    kernels,
) -> None:
    """Unforced calls take the Triton kernel on CUDA (it measured 2x faster than the chunked
    path on an H200) and the chunked path on the CPU; the process's choice overrides either way."""
    import tandem.kernels.logprobs as lp

    calls: list[str] = []

    def recording(name: str):  # noqa: ANN202 - the class's apply, noting that it ran
        apply = getattr(lp, name).apply

        def wrapper(*args):  # noqa: ANN002, ANN202
            calls.append(name)
            return apply(*args)

        return wrapper

    for name in ("_ChunkedLogprobs", "_TritonLogprobs"):
        monkeypatch.setattr(getattr(lp, name), "apply", recording(name))
    h, w, tgt = _inputs(6, 11, 8)
    kernels(None)
    ref, _ = token_logprobs_entropy_reference(h, w, tgt)
    logp, _ = token_logprobs_entropy(h, w, tgt, chunk_tokens=4)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
    default = (
        "_TritonLogprobs"
        if torch.cuda.is_available() and triton_available()
        else "_ChunkedLogprobs"
    )
    assert calls == [default]
    kernels("torch")
    logp, _ = token_logprobs_entropy(h, w, tgt, chunk_tokens=4)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
    assert calls == [default, "_ChunkedLogprobs"]
    if TRITON_OK:
        kernels("triton")
        logp, _ = token_logprobs_entropy(h, w, tgt)
        torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
        assert calls == [default, "_ChunkedLogprobs", "_TritonLogprobs"]
