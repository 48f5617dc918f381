"""Paged-KV attention: Triton kernels vs the PyTorch reference vs naive dense attention.

Without CUDA the Triton kernels run under the interpreter, so nothing here is
skipped on CPU except the CUDA-only class at the end. Shapes are tiny because the
interpreter is slow.

``TRITON_INTERPRET=1`` only works if set before ``triton`` is first imported (Triton
decorates its standard library at import). This module sets it, which suffices when
it runs alone or a ``conftest.py`` sets it too. If another test module imported
triton first, the interpreter is unusable in this process: then
`test_all_in_clean_subprocess` runs this whole file in a fresh interpreter and the
in-process copies of the tests are skipped with that reason.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tandem.kernels import paged_attention as pa
from tandem.kernels import paged_attention_torch as pt  # noqa: E402
from tandem.kernels.dispatch import (  # noqa: E402
    chosen_kernels,
    triton_available,
    triton_interpreting,
    use_triton,
)

if triton_available() and not torch.cuda.is_available():
    import triton.language  # noqa: E402, F401  (decorated for the interpreter if we came first)
IN_PROCESS = torch.cuda.is_available() or triton_interpreting()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]

# (context_len, q_len): prefill, extend onto a cached prefix, decode, and idle sequences.
MIXED = [(7, 7), (33, 5), (1, 1), (20, 1), (9, 0), (18, 18), (40, 3)]


@pytest.fixture(autouse=True)
def _needs_usable_triton(request: pytest.FixtureRequest) -> None:
    if not IN_PROCESS and request.node.name != "test_all_in_clean_subprocess":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET was set; "
            "covered by test_all_in_clean_subprocess"
        )


def test_all_in_clean_subprocess() -> None:
    if IN_PROCESS:
        return  # the tests below run in this process
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor  # [N, MB] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    context_lens: torch.Tensor  # [N] int32
    dense_k: list[torch.Tensor]  # per sequence [C, Hkv, D]
    dense_v: list[torch.Tensor]  # per sequence [C, Hkv, D]
    q_lens: list[int]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    impl: str,
    dtype: torch.dtype = torch.float32,
    max_blocks: int | None = None,
    seed: int = 0,
) -> Batch:
    """Random per-sequence K/V written into a paged cache through `store_kv` (two steps:
    the cached prefix, then the new tokens mixed with -1 padding rows), with shuffled,
    non-contiguous block ids and -1 in unused block-table entries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c, _ in seqs]
    mb = max_blocks or max(max(need), 1)
    num_blocks = sum(need) + 5  # spare blocks stay untouched
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), mb), -1, dtype=torch.int32)
    dense_k, dense_v, prefix_slots, new_slots = [], [], [], []
    for n, (ctx, q_len) in enumerate(seqs):
        ids, perm = perm[: need[n]], perm[need[n] :]
        tables[n, : need[n]] = torch.tensor(ids, dtype=torch.int32)
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
        prefix_slots += slots[: ctx - q_len]
        new_slots += slots[ctx - q_len :]
        dense_k.append(torch.randn(ctx, hkv, d, generator=g).to(dtype))
        dense_v.append(torch.randn(ctx, hkv, d, generator=g).to(dtype))
    cache_shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype).to(DEVICE)
    prefix_k = torch.cat([k[: c - ql] for k, (c, ql) in zip(dense_k, seqs, strict=True)])
    prefix_v = torch.cat([v[: c - ql] for v, (c, ql) in zip(dense_v, seqs, strict=True)])
    new_k = torch.cat([k[c - ql :] for k, (c, ql) in zip(dense_k, seqs, strict=True)])
    new_v = torch.cat([v[c - ql :] for v, (c, ql) in zip(dense_v, seqs, strict=True)])
    # Pad the new tokens with junk rows at slot -1 (front, back, and in between).
    junk = torch.randn(3, hkv, d, generator=g).to(dtype)
    new_k = torch.cat([junk[:1], new_k[:2], junk[1:2], new_k[2:], junk[2:]])
    new_v = torch.cat([junk[:1], new_v[:2], junk[1:2], new_v[2:], junk[2:]])
    new_slots = [-1] + new_slots[:2] + [-1] + new_slots[2:] + [-1]
    for k, v, s in ((prefix_k, prefix_v, prefix_slots), (new_k, new_v, new_slots)):
        slot_mapping = torch.tensor(s, dtype=torch.int64, device=DEVICE)
        pa.store_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slot_mapping, impl=impl)
    q_lens = [ql for _, ql in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return Batch(
        q=q.to(DEVICE),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(DEVICE),
        cu_seqlens_q=cu.to(DEVICE),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE),
        dense_k=dense_k,
        dense_v=dense_v,
        q_lens=q_lens,
    )


def naive_attention(b: Batch) -> torch.Tensor:  # [T, Hq, D] float64
    """Dense causal attention from the unpaged K/V, one query at a time, in float64."""
    q = b.q.double().cpu()
    out = torch.zeros_like(q)
    group = q.shape[1] // b.dense_k[0].shape[1]
    row = 0
    for k, v, q_len in zip(b.dense_k, b.dense_v, b.q_lens, strict=True):
        ctx = k.shape[0]
        k = k.double().repeat_interleave(group, dim=1)  # [C, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        for i in range(q_len):
            p = ctx - q_len + i
            s = (q[row][None] * k[: p + 1]).sum(-1) * b.scale  # [p+1, Hq]
            w = s.softmax(dim=0)
            out[row] = (w[..., None] * v[: p + 1]).sum(0)  # [Hq, D]
            row += 1
    return out


def run_attention(b: Batch, impl: str, **kwargs) -> torch.Tensor:
    return pa.paged_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.cu_seqlens_q,
        b.context_lens,
        b.scale,
        impl=impl,
        **kwargs,
    )


HEADS_AND_DIMS = [  # (block_size, Hq, Hkv, D)
    (4, 2, 2, 16),
    (16, 4, 2, 32),
    (4, 8, 1, 64),
    (16, 4, 2, 24),  # head_dim not a power of two
    (4, 6, 2, 80),  # group of 3 and head_dim 80
]


# ---------------------------------------------------------------------------
# The reference against naive dense attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,hq,hkv,d", HEADS_AND_DIMS + [(1, 4, 4, 16)])
def test_reference_matches_naive(block_size: int, hq: int, hkv: int, d: int) -> None:
    b = make_batch(MIXED, block_size=block_size, hq=hq, hkv=hkv, d=d, impl="torch")
    out = run_attention(b, "torch")
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    torch.testing.assert_close(out.double().cpu(), naive_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,hq,hkv,d", HEADS_AND_DIMS[:3])
def test_loop_reference_and_batched_fallback_match_naive(
    block_size: int, hq: int, hkv: int, d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-sequence loop (the oracle) and the batched path's fallback to it."""
    b = make_batch(MIXED, block_size=block_size, hq=hq, hkv=hkv, d=d, impl="torch")
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.context_lens, b.scale)
    naive = naive_attention(b)
    torch.testing.assert_close(
        pt.paged_attention_ref(*args).double().cpu(), naive, atol=1e-5, rtol=1e-5
    )
    monkeypatch.setattr(pt, "_BATCHED_SCORE_LIMIT", 0)
    torch.testing.assert_close(
        pt.paged_attention_torch(*args).double().cpu(), naive, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("block_size,hq,hkv,d", HEADS_AND_DIMS[:3])
def test_torch_pure_decode_matches_naive(block_size: int, hq: int, hkv: int, d: int) -> None:
    """One query per sequence takes the fused-SDPA branch of the PyTorch path (fp32); a
    padded row (context 0) takes the masked-softmax branch and gives zeros."""
    b = make_batch(
        [(9, 1), (3, 1), (17, 1), (1, 1)], block_size=block_size, hq=hq, hkv=hkv, d=d, impl="torch"
    )
    out = pa.paged_decode_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.scale, impl="torch"
    )
    torch.testing.assert_close(out.double().cpu(), naive_attention(b), atol=1e-5, rtol=1e-5)
    ctx = torch.cat([b.context_lens, b.context_lens.new_zeros(1)])
    tables = torch.cat([b.block_tables, torch.zeros_like(b.block_tables[:1])])
    q = torch.cat([b.q, torch.randn_like(b.q[:1])])
    padded = pa.paged_decode_attention(q, b.k_cache, b.v_cache, tables, ctx, b.scale, impl="torch")
    assert (padded[-1] == 0).all()
    torch.testing.assert_close(padded[:-1], out, atol=1e-6, rtol=1e-6)


def test_reference_store_kv_writes_only_valid_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    k = torch.arange(1, 4).float()[:, None, None].expand(3, 2, 8)  # [3, 2, 8]
    slots = torch.tensor([9, -1, 2])
    pa.store_kv(k, -k, k_cache, v_cache, slots, impl="torch")
    assert (k_cache[2, 1] == 1).all() and (k_cache[0, 2] == 3).all()
    assert (v_cache[2, 1] == -1).all() and (v_cache[0, 2] == -3).all()
    assert k_cache.abs().sum() == (1 + 3) * 16  # slot -1 (value 2) was skipped


@pytest.mark.parametrize("slots", [[9, -1, 2, 5], [3, 0, 11, 6]])
def test_store_kv_slots_matches_reference(slots: list[int]) -> None:
    """The generator's PyTorch store (slots resolved once per step) writes what the
    reference does."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    mapping = torch.tensor(slots, dtype=torch.int32)
    want = [torch.randn(3, 4, 2, 8, generator=g) for _ in range(2)]
    got = [c.clone() for c in want]
    pt.store_kv_ref(k, v, *want, mapping)
    resolved = pt.valid_slots(mapping)
    assert (resolved[1] is None) == (min(slots) >= 0)
    pt.store_kv_slots(k, v, *got, *resolved)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------
# Triton against the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,hkv,d", [(4, 1, 16), (16, 2, 24), (4, 3, 80)])
def test_store_kv_triton_matches_reference(block_size: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(1)
    t, num_blocks = 11, 6
    k = torch.randn(t, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[0, 4, 10]] = -1
    slots = slots.int().to(DEVICE)
    k_init = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE)
    v_init = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE)
    k_ref, v_ref, k_tri, v_tri = k_init.clone(), v_init.clone(), k_init.clone(), v_init.clone()
    pa.store_kv(k, v, k_ref, v_ref, slots, impl="torch")
    pa.store_kv(k, v, k_tri, v_tri, slots, impl="triton")
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    assert not torch.equal(k_ref, k_init)


def test_store_kv_triton_casts_to_cache_dtype() -> None:
    k = torch.randn(5, 2, 16, device=DEVICE)
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([0, 3, -1, 5, 7], device=DEVICE)
    pa.store_kv(k, k, caches[0], caches[1], slots, impl="torch")
    pa.store_kv(k, k, caches[2], caches[3], slots, impl="triton")
    assert torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("block_size,hq,hkv,d", HEADS_AND_DIMS)
def test_paged_attention_triton_matches_reference(
    block_size: int, hq: int, hkv: int, d: int
) -> None:
    b = make_batch(MIXED, block_size=block_size, hq=hq, hkv=hkv, d=d, impl="triton")
    ref = run_attention(b, "torch")
    out = run_attention(b, "triton")  # max_q_len read from cu_seqlens_q
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double().cpu(), naive_attention(b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(run_attention(b, "triton", max_q_len=18), ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_triton_long_prefill_spans_query_tiles() -> None:
    # 70 queries with group 4 -> 16 tokens per tile: 5 query tiles, several KV tiles.
    b = make_batch([(75, 70), (3, 2)], block_size=16, hq=8, hkv=2, d=16, impl="triton")
    torch.testing.assert_close(
        run_attention(b, "triton"), run_attention(b, "torch"), atol=1e-4, rtol=1e-4
    )


def test_paged_attention_empty_batches() -> None:
    b = make_batch([(5, 0), (3, 0)], block_size=4, hq=2, hkv=1, d=16, impl="torch")
    for impl in ("torch", "triton"):
        assert run_attention(b, impl).shape == (0, 2, 16)


@pytest.mark.parametrize("num_splits", [1, 3, 4, None])
@pytest.mark.parametrize("block_size,hq,hkv,d", [(4, 4, 2, 16), (16, 8, 1, 24)])
def test_decode_triton_matches_reference(
    num_splits: int | None, block_size: int, hq: int, hkv: int, d: int
) -> None:
    # Wide block tables (256 positions, KV tiles of 64): 3 splits are 128 positions each
    # (the third always empty), 4 splits are 64 each; short sequences leave later splits
    # empty, and 64 ends exactly on a split boundary.
    seqs = [(150, 1), (1, 1), (64, 1), (37, 1)]
    b = make_batch(
        seqs,
        block_size=block_size,
        hq=hq,
        hkv=hkv,
        d=d,
        impl="triton",
        max_blocks=256 // block_size,
    )
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.scale)
    ref = pa.paged_decode_attention(*args, impl="torch")
    out = pa.paged_decode_attention(*args, impl="triton", num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double().cpu(), naive_attention(b), atol=1e-4, rtol=1e-4)


def test_decode_padded_rows_give_zeros() -> None:
    """CUDA-graph padding: context_lens 0 and block tables of -1 must not read the cache."""
    b = make_batch([(9, 1), (3, 1)], block_size=4, hq=4, hkv=2, d=16, impl="triton", max_blocks=8)
    tables = torch.cat([b.block_tables, torch.full_like(b.block_tables[:1], -1)])
    ctx = torch.cat([b.context_lens, b.context_lens.new_zeros(1)])
    q = torch.cat([b.q, torch.randn_like(b.q[:1])])
    ref = pa.paged_decode_attention(q, b.k_cache, b.v_cache, tables, ctx, b.scale, impl="torch")
    assert (ref[2] == 0).all()
    for splits in (1, 2):
        out = pa.paged_decode_attention(
            q, b.k_cache, b.v_cache, tables, ctx, b.scale, impl="triton", num_splits=splits
        )
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_routes_pure_decode_to_decode_kernel() -> None:
    b = make_batch([(13, 1), (2, 1), (30, 1)], block_size=4, hq=4, hkv=1, d=32, impl="triton")
    ref = run_attention(b, "torch")
    torch.testing.assert_close(run_attention(b, "triton", max_q_len=1), ref, atol=1e-4, rtol=1e-4)


# The Triton interpreter computes tl.dot on bf16 operands wrongly, so bf16 runs on CUDA only.
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_triton_matches_reference(dtype: torch.dtype) -> None:
    seqs = [(19, 19), (26, 4), (11, 1)]
    b = make_batch(seqs, block_size=4, hq=4, hkv=2, d=32, impl="triton", dtype=dtype)
    ref = run_attention(b, "torch")
    out = run_attention(b, "triton")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    dq = torch.stack([b.q[cu - 1] for cu in b.cu_seqlens_q[1:].tolist()])  # last query of each
    dargs = (dq, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.scale)
    torch.testing.assert_close(
        pa.paged_decode_attention(*dargs, impl="triton", num_splits=2).float(),
        pa.paged_decode_attention(*dargs, impl="torch").float(),
        atol=2e-2,
        rtol=2e-2,
    )


# ---------------------------------------------------------------------------
# Argument checks and dispatch
# ---------------------------------------------------------------------------


def test_bad_shapes_raise() -> None:
    b = make_batch([(5, 2)], block_size=4, hq=4, hkv=2, d=16, impl="torch")
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_attention(
            b.q[:, :3],
            b.k_cache,
            b.v_cache,
            b.block_tables,
            b.cu_seqlens_q,
            b.context_lens,
            b.scale,
        )
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pa.paged_attention(
            b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q[:1], b.context_lens, b.scale
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        pa.store_kv(b.q[:, :2], b.q[:, :2], b.k_cache, b.v_cache, b.cu_seqlens_q.float())


def test_use_triton_precedence(monkeypatch: pytest.MonkeyPatch, kernels) -> None:
    cpu = torch.zeros(1)
    kernels(None)
    assert use_triton(cpu) is False  # CPU tensor: reference by default
    assert use_triton(cpu, "torch") is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_interpreting():  # CPU runs: conftest set it before triton was first imported
        assert use_triton(cpu, "triton") is True
        kernels("triton")
        assert use_triton(cpu) is True
    else:  # a CUDA machine: triton loaded compiled, so a CPU tensor cannot take the kernel
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            use_triton(cpu, "triton")
        kernels("triton")
        assert use_triton(torch.zeros(1, device="cuda")) is True
    assert use_triton(cpu, "torch") is False  # the argument beats the process's choice
    kernels("torch")
    assert use_triton(cpu) is False
    kernels("auto")
    assert chosen_kernels() is None and use_triton(cpu) is False
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of auto, triton, torch"):
        kernels("cuda")
    with pytest.raises(ValueError, match="impl"):
        use_triton(cpu, "tirton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        use_triton(cpu, "triton")


def test_imports_and_runs_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from tandem.kernels import paged_attention as pa\n"
        "from tandem.kernels.dispatch import triton_available, use_triton\n"
        "assert not triton_available() and not use_triton(torch.zeros(1))\n"
        "kc = torch.zeros(2, 4, 1, 8); vc = torch.zeros_like(kc)\n"
        "k = torch.randn(3, 1, 8)\n"
        "pa.store_kv(k, k, kc, vc, torch.tensor([0, 1, 2]))\n"
        "out = pa.paged_decode_attention(torch.randn(1, 2, 8), kc, vc,\n"
        "    torch.tensor([[0, 1]], dtype=torch.int32),\n"
        "    torch.tensor([3], dtype=torch.int32), 0.3)\n"
        "assert out.shape == (1, 2, 8) and 'tandem.kernels.triton_paged_attention' not in "
        "sys.modules\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------
# CUDA only: realistic sizes, bf16, graph capture
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    def test_bf16_realistic_batch(self) -> None:
        seqs = [(1000, 1000), (777, 129), (513, 1), (4096, 1), (17, 0), (300, 300)]
        b = make_batch(
            seqs, block_size=16, hq=32, hkv=8, d=128, impl="triton", dtype=torch.bfloat16
        )
        out = run_attention(b, "triton")
        torch.testing.assert_close(
            out.float(), run_attention(b, "torch").float(), atol=2e-2, rtol=2e-2
        )

    def test_decode_split_heuristic_long_context(self) -> None:
        seqs = [(8000, 1), (3, 1)]
        b = make_batch(
            seqs, block_size=16, hq=16, hkv=2, d=128, impl="triton", dtype=torch.bfloat16
        )
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.scale)
        ref = pa.paged_decode_attention(*args, impl="torch").float()
        for splits in (None, 1, 7):
            out = pa.paged_decode_attention(*args, impl="triton", num_splits=splits)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

    def test_decode_cuda_graph_capture(self) -> None:
        b = make_batch(
            [(50, 1), (7, 1)],
            block_size=16,
            hq=8,
            hkv=2,
            d=64,
            impl="triton",
            dtype=torch.bfloat16,
            max_blocks=8,
        )
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.scale)
        ref = pa.paged_decode_attention(*args, impl="triton")  # also compiles before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = pa.paged_decode_attention(*args, impl="triton")
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref)
