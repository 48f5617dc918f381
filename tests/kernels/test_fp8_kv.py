"""FP8 KV (tandem/kernels/kv_quant.py and the FP8 paths of the paged attention kernels).

- the quantizer: power-of-two scales (the smallest that fits, checked against float64 math),
  the round trip within the format's bound (half an ulp, or half the subnormal step),
  saturation to +-max, and the update's `fake_quant` giving back exactly what the pool holds;
- the Triton store (under the interpreter without CUDA) writes the same bytes and per-token
  scales as the PyTorch store, over values that span the formats' ranges;
- paged attention over an FP8 cache equals, bit for bit, the same path over a cache holding
  the dequantized values (Triton prefill and decode, split-K included; the PyTorch path;
  the per-sequence reference; the ``rl.exact`` path), and stays within a stated tolerance of
  attention over the original bf16 K/V.

As in test_triton_batch_invariant.py, if triton was imported before ``TRITON_INTERPRET`` was set,
the in-process Triton tests are skipped and `test_all_in_clean_subprocess` reruns this file.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tandem.kernels import batch_invariant  # noqa: E402
from tandem.kernels import kv_quant as kvq  # noqa: E402
from tandem.kernels import paged_attention as pa
from tandem.kernels import paged_attention_torch as pt  # noqa: E402
from tests.kernels.interpreted import interpreter_guard  # noqa: E402

_needs_usable_triton, test_all_in_clean_subprocess = interpreter_guard(__file__)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _wide(n: int, seed: int, spread: float = 12.0) -> torch.Tensor:
    """Values with exponents over ``2**-spread .. 2**spread`` (both signs), and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2((torch.rand(n, generator=g) * 2 - 1) * spread)
    x[::97] = 0.0
    return x


@pytest.mark.parametrize("dtype", FORMATS)
def test_scale_is_the_smallest_power_of_two_that_fits(dtype):
    amax = torch.cat(
        [_wide(4000, 1, 30).abs(), torch.tensor([0.0, 448.0, 449.0, 57344.0, 1e-40, 3e38])]
    )
    s = kvq.scale_from_amax(amax, dtype).double()
    m = kvq.fp8_max(dtype)
    k = torch.log2(s)
    assert torch.equal(k, k.round())  # powers of two
    inside = (amax > m * 2.0**-126) & (amax < m * 2.0**126)
    a = amax.double()[inside]
    assert (a <= m * s[inside]).all() and (
        a > m * s[inside] / 2
    ).all()  # fits, and half of it would not
    assert (s[~inside] >= 2.0**-126).all() and (s[~inside] <= 2.0**126).all()


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_head", "per_token"])
def test_round_trip_error_within_the_format_bound(dtype, per_token):
    x = _wide(8 * 4 * 64, 2).view(8 * 4, 4, 16) * 3.0  # [T, H, D]
    scale = (
        kvq.token_scales(x, dtype)[..., None]
        if per_token
        else kvq.scale_from_amax(x.abs().amax((0, 2)) * 0.5, dtype)[:, None]
    )  # per head: half the amax, so some saturate
    y = kvq.dequantize(kvq.quantize(x, scale, dtype), scale)
    sat = kvq.saturated(x, scale, dtype)
    m = kvq.fp8_max(dtype)
    if per_token:
        assert not sat.any()  # each row's own amax fits
    else:
        assert 0 < sat.float().mean() < 0.2
        assert torch.equal(
            y[sat], (torch.sign(x) * m * scale.expand_as(x))[sat]
        )  # clamped to +-max
    err = (y - x).abs()[~sat]
    bound = kvq.error_bound(x, scale.expand_as(x), dtype)[~sat]
    assert (err <= bound).all()
    # the bound is the format's: half an ulp (2**-(m+1) relative) of normal values, which is tight
    mant = kvq.MANTISSA_BITS[dtype]
    normal = (x.abs() / scale >= torch.finfo(dtype).smallest_normal)[~sat]
    rel = err[normal] / x.abs()[~sat][normal]
    assert rel.max() <= 2.0 ** -(mant + 1) and rel.max() > 0.8 * 2.0 ** -(mant + 1)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_is_what_the_pool_gives_back(dtype, model_dtype):
    """The update's rounding (`fake_quant`) and the pool's store + dequantize agree bit for bit,
    per head and per token; in bf16 too (a dequantized entry has at most 4 significant bits)."""
    x = (_wide(6 * 2 * 32, 3, 6).view(6, 2, 32) * 2).to(model_dtype)  # [T, Hkv, D]
    heads = kvq.scale_from_amax(x.float().abs().amax((0, 2)), dtype)
    slots = torch.tensor([3, 0, 7, 5, 1, 6])
    for scale in (heads, None):
        kc = torch.zeros(2, 4, 2, 32, dtype=dtype)
        sc = torch.zeros(2, 4, 2) if scale is None else scale
        pa.store_kv(x, x, kc, kc.clone(), slots, impl="torch", k_scale=sc, v_scale=sc.clone())
        back = pt.dequantize_pages(kc, sc, torch.arange(2)).view(8, 2, 32)[slots]
        assert torch.equal(back.to(model_dtype).float(), back)  # exact in the model's dtype
        assert torch.equal(kvq.fake_quant(x, dtype, scale), back.to(model_dtype))


def test_fake_quant_passes_the_gradient_straight_through():
    x = torch.randn(3, 2, 8, requires_grad=True)
    g = torch.randn(3, 2, 8)
    (kvq.fake_quant(x, torch.float8_e4m3fn, None) * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_head", "per_token"])
def test_triton_store_writes_the_same_bytes(dtype, per_token):
    """The Triton store kernel and the PyTorch store agree byte for byte (and on per-token
    scales), over values from subnormal to saturating, with skipped (-1) slots."""
    t, hkv, d, nb, bs = 40, 3, 24, 16, 4
    k = _wide(t * hkv * d, 4, 10).view(t, hkv, d)
    v = _wide(t * hkv * d, 5, 10).view(t, hkv, d)
    k[5] = (
        7.84  # rounds up across a power of two in e4m3 (the interpreter's own cast gets this wrong)
    )
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(0))[:t]
    slots[[0, 9, 17]] = -1
    out = {}
    for impl in ("torch", "triton"):
        kc = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        if per_token:
            ks, vs = (torch.zeros(nb, bs, hkv, device=DEVICE) for _ in range(2))
        else:
            ks = kvq.scale_from_amax(torch.full((hkv,), 100.0), dtype).to(
                DEVICE
            )  # some entries saturate
            vs = kvq.scale_from_amax(v.abs().amax((0, 2)), dtype).to(DEVICE)
        pa.store_kv(
            k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), impl=impl, k_scale=ks, v_scale=vs
        )
        out[impl] = [kc.view(torch.uint8), vc.view(torch.uint8), ks, vs]
    for a, b in zip(out["torch"], out["triton"], strict=True):
        assert torch.equal(a, b)
    assert out["torch"][0].any()


# ---- attention over FP8 pages --------------------------------------------------------------

SEQS = [(7, 7), (33, 5), (1, 1), (20, 1), (9, 0), (18, 18), (40, 3)]  # (context, new queries)


def _fp8_batch(
    dtype: torch.dtype,
    per_token: bool,
    q_dtype: torch.dtype,
    seqs=SEQS,
    bs: int = 4,
    hq: int = 4,
    hkv: int = 2,
    d: int = 32,
    seed: int = 0,
):
    """An FP8 paged cache of random sequences (shuffled blocks), its scales, the same cache
    dequantized to fp32, the original K/V, and queries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c, _ in seqs]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    slots = []
    for n, (c, _) in enumerate(seqs):
        ids, perm = perm[: need[n]], perm[need[n] :]
        tables[n, : need[n]] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // bs] * bs + p % bs for p in range(c)]
    t = len(slots)
    k = (torch.randn(t, hkv, d, generator=g) * 2).to(q_dtype)
    v = torch.randn(t, hkv, d, generator=g).to(q_dtype)
    kc = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    if per_token:
        ks, vs = (torch.zeros(nb, bs, hkv, device=DEVICE) for _ in range(2))
    else:
        ks, vs = (
            kvq.scale_from_amax(x.float().abs().amax((0, 2)), dtype).to(DEVICE) for x in (k, v)
        )
    pa.store_kv(
        k.to(DEVICE),
        v.to(DEVICE),
        kc,
        vc,
        torch.tensor(slots, device=DEVICE),
        impl="torch",
        k_scale=ks,
        v_scale=vs,
    )
    every = torch.arange(nb, device=DEVICE)
    kd, vd = pt.dequantize_pages(kc, ks, every), pt.dequantize_pages(vc, vs, every)
    # the original K/V in a cache of q's dtype (bf16 attention's input)
    ko, vo = (
        torch.zeros(nb, bs, hkv, d, dtype=q_dtype, device=DEVICE),
        torch.zeros(nb, bs, hkv, d, dtype=q_dtype, device=DEVICE),
    )
    pa.store_kv(
        k.to(DEVICE), v.to(DEVICE), ko, vo, torch.tensor(slots, device=DEVICE), impl="torch"
    )
    q_lens = [q for _, q in seqs]
    cu = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(q_dtype).to(DEVICE)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE)
    return dict(
        q=q,
        kc=kc,
        vc=vc,
        ks=ks,
        vs=vs,
        kd=kd,
        vd=vd,
        ko=ko,
        vo=vo,
        tables=tables.to(DEVICE),
        cu=cu,
        ctx=ctx,
    )


def _caches(b, which):
    """(K cache, V cache, scale kwargs): the FP8 pages, the dequantized values (fp32: every
    path casts what it reads to the query's dtype or computes in fp32) or the original K/V."""
    return {
        "fp8": (b["kc"], b["vc"], dict(k_scale=b["ks"], v_scale=b["vs"])),
        "dequantized": (b["kd"], b["vd"], {}),
        "original": (b["ko"], b["vo"], {}),
    }[which]


def _attend(b, impl, which):
    kc, vc, scales = _caches(b, which)
    return pa.paged_attention(
        b["q"],
        kc,
        vc,
        b["tables"],
        b["cu"],
        b["ctx"],
        b["q"].shape[-1] ** -0.5,
        impl=impl,
        **scales,
    )


def _decode(b, impl, which, num_splits=None):
    last = (b["cu"][1:] - 1).clamp(min=0).long()  # each sequence's last query (a decode step's)
    kc, vc, scales = _caches(b, which)
    return pa.paged_decode_attention(
        b["q"][last],
        kc,
        vc,
        b["tables"],
        b["ctx"],
        b["q"].shape[-1] ** -0.5,
        impl=impl,
        num_splits=num_splits,
        **scales,
    )


# The Triton interpreter has no bf16 (numpy has none): there half precision is fp16, as in
# test_paged_attention.py.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16
CASES = [
    (dt, pt, qd) for dt in FORMATS for pt in (False, True) for qd in (torch.float32, torch.bfloat16)
]
IDS = [f"{str(dt)[11:]}-{'token' if pt else 'head'}-{str(qd)[6:]}" for dt, pt, qd in CASES]


@pytest.mark.parametrize("dtype,per_token,q_dtype", CASES, ids=IDS)
def test_torch_path_equals_attention_on_dequantized_kv(dtype, per_token, q_dtype):
    b = _fp8_batch(dtype, per_token, q_dtype)
    assert torch.equal(_attend(b, "torch", "fp8"), _attend(b, "torch", "dequantized"))
    assert torch.equal(_decode(b, "torch", "fp8"), _decode(b, "torch", "dequantized"))
    ref = pt.paged_attention_ref(
        b["q"], b["kc"], b["vc"], b["tables"], b["cu"], b["ctx"], 32**-0.5, b["ks"], b["vs"]
    )
    assert torch.equal(
        ref,
        pt.paged_attention_ref(b["q"], b["kd"], b["vd"], b["tables"], b["cu"], b["ctx"], 32**-0.5),
    )


@pytest.mark.parametrize(
    "dtype,per_token,q_dtype",
    [(d, p, HALF if q != torch.float32 else q) for d, p, q in CASES],
    ids=IDS,
)
def test_triton_equals_attention_on_dequantized_kv(dtype, per_token, q_dtype):
    b = _fp8_batch(dtype, per_token, q_dtype)
    got = _attend(b, "triton", "fp8")
    assert torch.equal(got, _attend(b, "triton", "dequantized"))
    for splits in (1, 3):
        assert torch.equal(
            _decode(b, "triton", "fp8", splits), _decode(b, "triton", "dequantized", splits)
        )
    # and the Triton kernel is the reference's math (to its own rounding) on these pages
    ref = pt.paged_attention_ref(
        b["q"], b["kc"], b["vc"], b["tables"], b["cu"], b["ctx"], 32**-0.5, b["ks"], b["vs"]
    )
    rows = _query_rows(b)
    torch.testing.assert_close(
        got[rows].float(),
        ref[rows].float(),
        atol=2e-3 if q_dtype != torch.float32 else 1e-5,
        rtol=1e-2 if q_dtype != torch.float32 else 1e-5,
    )


def _query_rows(b) -> torch.Tensor:
    return torch.cat(
        [torch.arange(int(b["cu"][n]), int(b["cu"][n + 1])) for n in range(len(b["ctx"]))]
    )


@pytest.mark.parametrize("per_token", [False, True], ids=["per_head", "per_token"])
def test_exact_path_equals_attention_on_dequantized_kv(per_token):
    b = _fp8_batch(torch.float8_e4m3fn, per_token, torch.float32)
    with batch_invariant.exact_mode():
        assert torch.equal(_attend(b, "torch", "fp8"), _attend(b, "torch", "dequantized"))


# Attention over FP8 K/V against attention over the original K/V in half precision (the
# rollout's bf16, or fp16 under the Triton interpreter), on this workload: unit-variance
# queries, K with std 2 and V with std 1, head_dim 32, calibrated (per-head) scales. K's
# rounding moves each score by up to 2**-4 (e4m3) or 2**-3 (e5m2) of its products' size,
# and the output moves with the softmax weights. Largest differences measured over 3 seeds:
# e4m3 0.172 (PyTorch path, bf16) and 0.167 (Triton, fp16); e5m2 0.383 and 0.388. The
# tolerance is 1.5x the largest.
TOLERANCE = {torch.float8_e4m3fn: 0.26, torch.float8_e5m2: 0.58}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", FORMATS)
def test_fp8_attention_near_half_precision_attention(dtype, impl):
    worst = 0.0
    for seed in range(3):
        b = _fp8_batch(dtype, False, torch.bfloat16 if impl == "torch" else HALF, seed=seed)
        rows = _query_rows(b)
        got, want = (
            _attend(b, impl, "fp8").float()[rows],
            _attend(b, impl, "original").float()[rows],
        )
        worst = max(worst, (got - want).abs().max().item())
    assert 0 < worst < TOLERANCE[dtype], worst
