"""``rl.exact``: the generator's log-prob of every sampled token equals the update's
recomputation bit for bit (packed micro-batches, shared prompts, preemption and recompute,
fp32 and bf16 on the CPU), and a sequence's log-probs do not depend on its neighbours.

The reference is the other phase: the generator (paged prefill, decode, its own batches)
against `recompute_logprobs` (packed rows, training attention, chunked vocab). Without
exact mode the same comparison differs in the last bits (asserted too, so the test shows
that it measures something). The same holds on the Triton path (advanced.kernels = triton under
the interpreter: the batch-invariant Triton matmul and exact attention, Triton K/V stores and
sampling noise), on a smaller workload.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.kernels import batch_invariant
from tandem.kernels.dispatch import triton_interpreting
from tandem.models.hf import load_model
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import completion_tensors, recompute_logprobs
from tandem.rl.update.packing import pack_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")


@pytest.fixture(scope="module")
def models(device):
    m = load_model(POLICY).to(device).eval()
    return {torch.float32: m, torch.bfloat16: load_model(POLICY).to(device, torch.bfloat16).eval()}


@pytest.fixture
def exact():
    with batch_invariant.exact_mode():
        yield


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, 500, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def _generate(
    model, prompts, n, *, num_blocks=256, sharing=True, budget=64, max_tokens=12, seeds=None
):
    settings = GenerationSettings(
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=32,
        prefix_sharing=sharing,
        max_model_len=64,
    )
    gen = Generator(model, settings)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=s)
        for s in (seeds or [1000 * i for i in range(len(prompts))])
    ]
    out = gen.generate(prompts, params, n=n)
    samples = []
    for group, (p, comps) in enumerate(zip(prompts, out)):
        for c in comps:
            lp = iter(c.raw_logprobs)
            samples.append(
                RolloutSample(
                    group=group,
                    prompt_ids=p,
                    completion_ids=c.token_ids,
                    loss_mask=c.sampled_mask,
                    gen_logprobs=[next(lp) if m else 0.0 for m in c.sampled_mask],
                    finish_reason=c.finish_reason,
                    text="",
                    row={},
                )
            )
    return samples, gen.stats.preemptions


def _gap(model, samples, budget, share):
    dev = next(model.parameters()).device  # the conformance suite's --device
    mask, gen_logp, width = completion_tensors(samples, dev)
    mbs = pack_micro_batches(samples, list(range(len(samples))), budget, dev, share_prompts=share)
    logp = recompute_logprobs(model, samples, mbs, width, dev, chunk_tokens=7)
    diff = (logp - gen_logp).abs() * mask
    return float(diff.max()), int((diff > 0).sum()), int(mask.sum()), len(mbs)


@pytest.mark.conformance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["packed", "shared_prompts", "preemption"])
def test_exact_gap_is_zero(models, dtype, case):
    model = models[dtype]
    prompts = _prompts(6, seed=1)
    kw = {"preemption": dict(num_blocks=20, budget=16)}.get(case, {})
    with batch_invariant.exact_mode():
        samples, preempted = _generate(model, prompts, 4, **kw)
        gap, differ, tokens, n_mb = _gap(model, samples, 90, share=case == "shared_prompts")
    assert tokens > 200 and n_mb > 2  # several micro-batches, many tokens
    if case == "preemption":
        assert preempted > 0
    assert gap == 0.0 and differ == 0, (gap, differ, tokens)


@pytest.mark.conformance
def test_without_exact_the_same_comparison_differs(models):
    """The control: the default kernels give a gap in the last bits on the same workload."""
    samples, _ = _generate(models[torch.float32], _prompts(6, seed=1), 4)
    gap, differ, tokens, _ = _gap(models[torch.float32], samples, 90, share=False)
    assert 0 < gap < 1e-4 and differ > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_alone_or_with_neighbours(models, dtype, exact):
    """The same sequence's log-probs in the generator (prefill and decode) and in the training
    forward, alone and next to 1, 7 or 63 random neighbours: identical bits everywhere."""
    model = models[dtype]
    target = _prompts(1, seed=7, lo=20, hi=21)
    alone, _ = _generate(model, target, 1, max_tokens=10, seeds=[5])
    ref = alone[0]
    mask, _, width = completion_tensors([ref], torch.device("cpu"))
    for k in (1, 7, 63):
        others = _prompts(k, seed=k)
        # generation: the target's prompt prefilled and its tokens decoded among k other sequences
        seeds = [1000 * (i + 1) for i in range(k)]
        batch, _ = _generate(
            model,
            others[: k // 2] + target + others[k // 2 :],
            1,
            budget=256,
            max_tokens=10,
            seeds=seeds[: k // 2] + [5] + seeds[k // 2 :],
        )
        mine = batch[k // 2]
        assert (
            mine.completion_ids == ref.completion_ids and mine.gen_logprobs == ref.gen_logprobs
        ), k
        # training forward: one packed micro-batch, and one row per sequence
        for budget in (10_000, 1):
            rows = [ref] + [s for i, s in enumerate(batch) if i != k // 2]
            _, gen_logp, w = completion_tensors(rows, torch.device("cpu"))
            mbs = pack_micro_batches(rows, list(range(len(rows))), budget, torch.device("cpu"))
            logp = recompute_logprobs(model, rows, mbs, w, torch.device("cpu"), chunk_tokens=5)
            assert torch.equal(logp[0, :width] * mask[0], gen_logp[0, :width] * mask[0]), (
                k,
                budget,
            )


ON_TRITON = pytest.mark.skipif(
    not triton_interpreting(),
    reason="the Triton path on CPU tensors needs "
    "TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)",
)


def _triton_gap(
    model, monkeypatch, kernels, share: bool, exact: bool
) -> tuple[float, int, int, int, int]:
    """`_gap` on a small workload with every kernel on its Triton form (advanced.kernels = triton,
    under the interpreter, which is slow), and the fewer of the Triton matmul's and the Triton
    exact attention's call counts."""
    kernels("triton")
    from tandem.kernels import triton_batch_invariant

    calls = {"matmul": 0, "attention": 0}
    for name in calls:
        real = getattr(triton_batch_invariant, name)
        monkeypatch.setattr(
            triton_batch_invariant,
            name,
            lambda *a, _name=name, _real=real, **kw: (
                calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **kw)
            ),
        )
    with batch_invariant.exact_mode(exact):
        samples, _ = _generate(model, _prompts(3, seed=2, hi=16), 2, max_tokens=6, budget=24)
        return (*_gap(model, samples, 30, share=share), min(calls.values()))


@ON_TRITON
@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared_prompts"])
def test_exact_gap_is_zero_on_the_triton_path(models, monkeypatch, kernels, share):
    """The same property with the kernels in their Triton forms: the Triton batch-invariant
    matmul and exact attention, K/V stores and sampling noise in their Triton kernels."""
    gap, differ, tokens, n_mb, calls = _triton_gap(
        models[torch.float32], monkeypatch, kernels, share, exact=True
    )
    assert tokens == 36 and n_mb > 1 and calls > 20
    assert gap == 0.0 and differ == 0, (gap, differ, tokens)


@ON_TRITON
def test_without_exact_the_triton_path_differs(models, monkeypatch, kernels):
    """Its control: the Triton paged attention and log-prob kernels, no exact kernels, a gap."""
    gap, differ, _, _, calls = _triton_gap(
        models[torch.float32], monkeypatch, kernels, False, exact=False
    )
    assert 0 < gap < 1e-4 and differ > 0 and calls == 0
