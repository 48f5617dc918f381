"""Sampler: truncations against hand-written references, exact log-probs, seeding, frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.rl.generator.sampler import Sampler, exponential_noise, truncation_mask
from tandem.rl.generator.sequence import SamplingParams


def ref_keep(
    logits: list[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> set[int]:
    """Naive reference of the documented order: top-k, top-p on the renormalised rest, min-p."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if top_k:
        order = order[:top_k]
    z = sum(math.exp(logits[i]) for i in order)
    probs = {i: math.exp(logits[i]) / z for i in order}
    if top_p < 1:
        kept, mass = [], 0.0
        for i in order:  # the smallest prefix whose mass reaches top_p
            kept.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        order = kept
    top = max(probs[i] for i in order)
    return {i for i in order if probs[i] >= min_p * top}


def ref_logprobs(logits: list[float], temperature: float, **trunc: float) -> dict[int, float]:
    """log of the renormalised truncated distribution, over the kept tokens."""
    scaled = [x / temperature for x in logits]
    keep = ref_keep(scaled, **trunc)
    z = sum(math.exp(scaled[i]) for i in keep)
    return {i: scaled[i] - math.log(z) for i in keep}


def mask_rows(mask: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row).flatten().tolist()) for row in mask]


LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.5, -1.0, 3.0, 0.0, 0.2],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],  # all tied
        [5.0, -2.0, 1.0, 4.0, 0.3, 0.31, -0.5, 2.5],
    ]
)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_top_k_keeps_exactly_k(k: int) -> None:
    mask = truncation_mask(LOGITS, [k] * 3, [1.0] * 3, [0.0] * 3)
    assert mask.sum(dim=-1).tolist() == [k] * 3
    assert mask_rows(mask) == [ref_keep(row, top_k=k) for row in LOGITS.tolist()]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.77, 0.95])
def test_top_p_keeps_smallest_prefix_reaching_p(p: float) -> None:
    mask = truncation_mask(LOGITS, [0] * 3, [p] * 3, [0.0] * 3)
    assert mask_rows(mask) == [ref_keep(row, top_p=p) for row in LOGITS.tolist()]
    # hand check of row 0: sorted probs 0.557 (id 5), 0.205 (0), 0.075 (1), 0.046 (2), 0.046 (3),
    # 0.034 (7), ...: cumulative 0.557, 0.762, 0.837, 0.883, 0.929, 0.962, ...
    by_hand = {0.05: {5}, 0.3: {5}, 0.5: {5}, 0.77: {5, 0, 1}, 0.95: {5, 0, 1, 2, 3, 7}}
    assert mask_rows(mask)[0] == by_hand[p]


@pytest.mark.parametrize("m", [0.05, 0.2, 0.5, 1.0])
def test_min_p_keeps_tokens_above_fraction_of_max(m: float) -> None:
    mask = truncation_mask(LOGITS, [0] * 3, [1.0] * 3, [m] * 3)
    assert mask_rows(mask) == [ref_keep(row, min_p=m) for row in LOGITS.tolist()]
    probs = torch.softmax(LOGITS, -1)
    expected = probs >= m * probs.max(-1, keepdim=True).values
    assert torch.equal(mask, expected)


def test_per_row_truncation_settings_and_order() -> None:
    settings = [
        dict(top_k=3, top_p=0.8, min_p=0.0),
        dict(top_k=0, top_p=1.0, min_p=0.0),
        dict(top_k=4, top_p=0.9, min_p=0.3),
    ]
    mask = truncation_mask(
        LOGITS,
        [s["top_k"] for s in settings],
        [s["top_p"] for s in settings],
        [s["min_p"] for s in settings],
    )
    assert mask_rows(mask) == [
        ref_keep(row, **s) for row, s in zip(LOGITS.tolist(), settings, strict=True)
    ]
    assert mask[1].all()


def test_logprobs_are_the_renormalised_truncated_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 12) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(top_p=0.6),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=0.5, top_k=6, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    for index in range(20):
        keys = [(s, index) for s in range(len(params))]
        tokens, logprobs, raw = Sampler().sample(logits, params, keys)
        for row, p in enumerate(params):
            ref = ref_logprobs(
                logits[row].tolist(), p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p
            )
            token = tokens[row].item()
            assert token in ref
            assert logprobs[row].item() == pytest.approx(ref[token], abs=1e-5)
        assert torch.allclose(
            raw, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
        )
    assert (
        logprobs.dtype == torch.float32
        and raw.dtype == torch.float32
        and tokens.dtype == torch.long
    )


def test_greedy_rows_take_argmax_with_zero_logprob() -> None:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, top_k=2),
        SamplingParams(),
    ]
    tokens, logprobs, raw = Sampler().sample(LOGITS[[0, 2, 0]], params, [(1, 0), (2, 0), (3, 0)])
    assert tokens[:2].tolist() == [5, 0]
    assert logprobs[:2].tolist() == [0.0, 0.0]
    assert raw[0].item() == pytest.approx(torch.log_softmax(LOGITS[0], -1)[5].item())
    tokens, logprobs, _ = Sampler().sample(
        LOGITS, [SamplingParams(temperature=0)] * 3, [(0, 0)] * 3
    )
    assert tokens.tolist() == LOGITS.argmax(-1).tolist() and not logprobs.any()


def test_seeded_row_same_alone_and_in_any_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    target = SamplingParams(temperature=0.9, seed=42)
    others = [
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0),
        SamplingParams(top_k=7, min_p=0.2),
        SamplingParams(temperature=1.5),
    ]
    for index in (0, 3, 117):
        alone = Sampler().sample(logits[:1], [target], [(42, index)])
        batch = Sampler().sample(
            logits[[1, 2, 0, 3, 4]],
            [others[0], others[1], target, others[2], others[3]],
            [(7, 1), (8, 2), (42, index), (9, 3), (10, 4)],
        )
        assert batch[0][2].item() == alone[0][0].item()
        assert batch[1][2].item() == pytest.approx(alone[1][0].item(), abs=1e-6)
        assert batch[2][2].item() == pytest.approx(alone[2][0].item(), abs=1e-6)
    # same key -> same token; the randomness moves with the token index and the seed
    draws = {Sampler().sample(logits[:1], [target], [(42, i)])[0].item() for i in range(40)}
    assert len(draws) > 10
    noise = exponential_noise([(42, 5), (42, 5), (42, 6), (43, 5)], 300)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[3])


def test_noise_computed_ahead_gives_the_same_tokens(monkeypatch) -> None:
    """Steps whose keys move on by one, a row that joins, a finished row, a recomputed
    (repeated) key and a duplicate key: the same tokens and log-probs with the noise
    computed 8 steps ahead as with each step's own, from far fewer noise calls."""
    import tandem.rl.generator.sampler as sampler_module

    calls = []
    real = sampler_module.exponential_noise
    monkeypatch.setattr(
        sampler_module,
        "exponential_noise",
        lambda keys, *a, **kw: calls.append(len(keys)) or real(keys, *a, **kw),
    )
    torch.manual_seed(3)
    steps = [[(s, i) for s in (5, 6, 7)] for i in range(10, 20)]
    steps[4] = steps[4] + [(9, 0)]  # joins
    steps[5] = steps[5] + [(9, 1)]
    steps[6] = [(5, 16), (6, 16)]  # 7 finished, 9 gone
    steps[7] = [(5, 16), (6, 17), (6, 17)]  # 5 recomputed after preemption; a duplicate key
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20)]
    ahead, single = Sampler(ahead=8), Sampler(ahead=1)
    for keys in steps:
        logits = torch.randn(len(keys), 64)
        rows = [params[i % 2] for i in range(len(keys))]
        got, want = ahead.sample(logits, rows, keys), single.sample(logits, rows, keys)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    logits = torch.randn(3, 32)  # the same keys again, another vocabulary: a new block
    for g, w in zip(
        ahead.sample(logits, params[:1] * 3, steps[-1]),
        single.sample(logits, params[:1] * 3, steps[-1]),
    ):
        assert torch.equal(g, w)
    steps.append(steps[-1])
    ahead_calls = sum(1 for n in calls if n > len(steps[0]) + 1)  # the blocks computed ahead
    assert len(calls) - ahead_calls == len(steps)  # the single-step sampler: one call per step
    assert 0 < ahead_calls < len(steps) // 2
    before = len(calls)  # a budget below two rows of lookahead: each step computes its own noise
    Sampler(budget=64 * 4).sample(torch.randn(4, 64), params[:1] * 4, steps[0] + [(1, 1)])
    assert calls[before:] == [4]


def test_hash_matches_exact_integer_arithmetic() -> None:
    """The tensor hash (int64 products that wrap) equals Python's exact big-int version."""
    from tandem.rl.generator.sampler import _mix32

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF] + list(
        torch.randint(0, 2**32, (2000,)).tolist()
    )
    got = _mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix(x) for x in xs]


def test_noise_is_standard_exponential() -> None:
    noise = exponential_noise([(s, i) for s in range(40) for i in range(50)], 256)  # 512k draws
    assert noise.min().item() > 0 and torch.isfinite(noise).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)
    assert noise.var().item() == pytest.approx(1.0, abs=0.02)
    u = torch.exp(-noise).flatten()  # back to uniform: flat histogram
    hist = torch.histc(u, bins=20, min=0, max=1) / u.numel()
    assert (hist - 0.05).abs().max().item() < 0.002
    adjacent = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]
    assert abs(adjacent.item()) < 0.01


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return (((counts - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize(
    "params,varying",
    [
        (SamplingParams(temperature=0.7), "index"),
        (SamplingParams(temperature=1.0), "seed"),
        (SamplingParams(temperature=1.2, top_k=4, top_p=0.8), "index"),
        (SamplingParams(min_p=0.15), "seed"),
    ],
)
def test_empirical_frequencies_match_distribution(params: SamplingParams, varying: str) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 1.4, 0.0, -2.0, 0.8, 0.6])
    n = 40_000
    keys = [(3, i) for i in range(n)] if varying == "index" else [(s, 0) for s in range(n)]
    tokens, logprobs, _ = Sampler().sample(logits.expand(n, -1), [params] * n, keys)
    ref = ref_logprobs(
        logits.tolist(),
        params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
    )
    counts = torch.bincount(tokens, minlength=8).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == set(ref)  # never a truncated token
    kept = sorted(ref)
    probs = torch.tensor([math.exp(ref[i]) for i in kept], dtype=torch.float64)
    # chi-square with len(kept)-1 degrees of freedom (<= 7); 24.3 is its 99.9% quantile at 7
    assert chi_square(counts[kept], probs) < 24.3
    assert torch.allclose(
        logprobs.double(),
        torch.tensor([ref[t] for t in tokens.tolist()], dtype=torch.float64),
        atol=1e-5,
    )


def test_sampling_params_validate() -> None:
    for bad, field in [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad)
    p = SamplingParams()
    p.top_k = -3  # mutated after construction: validate() catches it
    with pytest.raises(ValueError, match="top_k"):
        p.validate()


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="3 logit rows"):
        Sampler().sample(LOGITS, [SamplingParams()] * 2, [(0, 0)] * 3)


def _triton_can_run() -> bool:
    from tandem.kernels.dispatch import triton_available, triton_interpreting

    return triton_available() and (torch.cuda.is_available() or triton_interpreting())


@pytest.mark.skipif(not _triton_can_run(), reason="Triton cannot run here")
@pytest.mark.parametrize("vocab", [1, 17, 1500])
def test_one_pass_noise_matches_the_tensor_hash(vocab: int) -> None:
    """tandem.kernels.sampling_noise: the same 23-bit uniforms as the int64 tensor hash, bit for
    bit (read back through exp), and E = -log(u) within a few ulp of torch's log (numpy's
    log under the interpreter differs from torch's CPU log by up to 3 ulp)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = [(s, i) for s in (0, 42, 2**63 + 5, 2**64 - 1) for i in (0, 1, 2**40)]
    want = exponential_noise(keys, vocab, device, impl="torch")
    got = exponential_noise(keys, vocab, device, impl="triton")
    assert got.shape == want.shape == (len(keys), vocab) and got.dtype == torch.float32

    def uniforms(e: torch.Tensor) -> torch.Tensor:  # the hash's 23 bits, recovered exactly
        return torch.round(torch.exp(-e.double()) * 2**23 - 0.5)

    assert torch.equal(uniforms(got), uniforms(want))
    ulp = (got.view(torch.int32) - want.view(torch.int32)).abs().max().item()
    assert ulp <= 4
    assert exponential_noise([], vocab, device, impl="triton").shape == (0, vocab)


@pytest.mark.skipif(not _triton_can_run(), reason="Triton cannot run here")
def test_one_pass_noise_only_when_forced(kernels) -> None:
    """The kernel is untimed, so unforced calls keep the tensor hash on every device;
    advanced.kernels = triton routes the sampler's noise through it, with the same tokens."""
    from tandem.kernels.sampling_noise import use_one_pass_noise

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    probe = torch.empty(0, device=device)
    kernels(None)
    assert not use_one_pass_noise(probe)
    torch.manual_seed(0)
    logits = (3 * torch.randn(6, 200)).to(device)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)] * 3
    keys = [(11, i) for i in range(6)]
    want = Sampler(ahead=1).sample(logits, params, keys)
    kernels("triton")
    assert use_one_pass_noise(probe)
    got = Sampler(ahead=1).sample(logits, params, keys)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_a_temperature_below_the_floor_is_greedy():
    """1e-300 divides logits into inf (every row NaN, token 0 sampled); below MIN_TEMPERATURE
    a row is greedy: the argmax, log-prob 0, alone or beside sampled rows."""
    from tandem.rl.generator.sequence import MIN_TEMPERATURE

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 30
    want = logits.argmax(dim=-1)
    tiny = [SamplingParams(temperature=t) for t in (1e-300, 1e-38, MIN_TEMPERATURE / 2, 0.0)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    keys = [(7, i) for i in range(4)]
    tokens, logprobs, raw = Sampler().sample(logits, tiny, keys)
    assert torch.equal(tokens, want) and torch.equal(logprobs, torch.zeros(4))
    assert torch.allclose(
        raw, torch.log_softmax(logits, -1).gather(1, want[:, None])[:, 0], atol=1e-5
    )
    mixed = [tiny[0], SamplingParams(temperature=0.7), tiny[2], SamplingParams(top_k=5)]
    tokens, logprobs, _ = Sampler().sample(logits, mixed, keys)
    assert tokens[0] == want[0] and tokens[2] == want[2] and logprobs[0] == logprobs[2] == 0
    assert torch.isfinite(logprobs).all()
