"""FP8 KV in the generator against the update's recomputation (rollout.kv_dtype).

The generator samples with an FP8 pool (calibrated per-head scales, or per-token ones); the
update recomputes the sampled tokens' log-probs in packed micro-batches with the training
attention wrapped in `KVQuantAttention` (what ``rollout.kv_quantize_update`` sets as the
policy's ``kv_wrap``), which rounds K and V as the pool did:

- the gap is float noise (as without FP8), and 0 bit for bit under ``rl.exact`` (fp32 and bf16);
- without the wrapper the update computes the unquantized policy, and the gap it measures is
  the quantization's: equal, to float noise, to the difference between the update's own
  forwards with and without the rounding, and far above float noise;
- the same on the Triton path (advanced.kernels = triton under the interpreter; small workload).

Also: a pool refuses to run FP8 with calibrated scales it was not given, and its capacity in
sequences at a fixed kv_cache_gb is about twice bf16's.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.kernels import batch_invariant
from tandem.kernels import kv_quant as kvq
from tandem.kernels.dispatch import triton_interpreting
from tandem.models.attention import CausalAttention
from tandem.models.hf import load_model
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import completion_tensors, recompute_logprobs
from tandem.rl.update.packing import pack_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def models():
    m = load_model(POLICY).eval()
    return {torch.float32: m, torch.bfloat16: load_model(POLICY).to(torch.bfloat16).eval()}


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, 500, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def _amax(model, prompts) -> torch.Tensor:
    """Per (layer, K/V, KV head) amax over the prompts, from a plain causal forward (the
    reference for the calibration's observer)."""
    a = model.args
    amax = torch.zeros(a.num_layers, 2, a.num_kv_heads)

    def capture(layer, q, k, v):
        for i, x in enumerate((k, v)):
            amax[layer, i] = torch.maximum(
                amax[layer, i], x.detach().float().abs().amax(dim=(0, 1, 3))
            )
        return CausalAttention()(layer, q, k, v)

    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]), attn=capture)
    return amax


def _scales(model, per_token: bool) -> torch.Tensor | None:
    return None if per_token else kvq.scale_from_amax(_amax(model, _prompts(6, seed=9)), E4M3)


def _generate(model, prompts, n, scales, per_token, *, max_tokens=12, budget=64, num_blocks=256):
    settings = GenerationSettings(
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=32,
        max_model_len=64,
        kv_dtype="fp8_e4m3",
        kv_scales="per_token" if per_token else "calibrated",
    )
    gen = Generator(model, settings, kv_scales=scales)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1000 * i)
        for i in range(len(prompts))
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
    return samples, gen


def _recompute(model, samples, wrap, budget=90):
    """The update's log-probs [N, T] (packed micro-batches), ``wrap`` as the policy's kv_wrap."""
    _, _, width = completion_tensors(samples, torch.device("cpu"))
    mbs = pack_micro_batches(samples, list(range(len(samples))), budget, torch.device("cpu"))
    for mb in mbs:
        mb.kv_wrap = wrap
    return recompute_logprobs(model, samples, mbs, width, torch.device("cpu"), chunk_tokens=7), len(
        mbs
    )


def _wrap(scales):
    return lambda inner: kvq.KVQuantAttention(inner, E4M3, scales)


def _gaps(model, samples, scales, control: bool = True):
    """(mask, generator log-probs, the update's with the rounding, without it (``control``),
    micro-batches)."""
    mask, gen_logp, _ = completion_tensors(samples, torch.device("cpu"))
    matched, n_mb = _recompute(model, samples, _wrap(scales))
    plain = _recompute(model, samples, None)[0] if control else None
    return mask, gen_logp, matched, plain, n_mb


@pytest.mark.parametrize("per_token", [False, True], ids=["calibrated", "per_token"])
def test_matching_update_gap_is_float_noise_and_without_it_the_quantization(models, per_token):
    model = models[torch.float32]
    scales = _scales(model, per_token)
    samples, _ = _generate(model, _prompts(6, seed=1), 4, scales, per_token)
    mask, gen_logp, matched, plain, n_mb = _gaps(model, samples, scales)
    tokens = int(mask.sum())
    assert tokens > 200 and n_mb > 2
    gap = (matched - gen_logp).abs() * mask
    # float noise: what the default (unquantized) pool gives here is ~4e-7 mean, 5e-6 max
    # (test_exact_gap's control); a K entry that a last-bit difference moves across an FP8
    # rounding boundary moves by a whole FP8 step, so the max is allowed more
    assert gap.sum() / tokens < 5e-6 and gap.max() < 1e-3, (gap.sum() / tokens, gap.max())
    unmatched = (plain - gen_logp).abs() * mask  # what the gap metric reports without the setting
    quantization = (
        plain - matched
    ).abs() * mask  # the update's own forwards, with and without the rounding
    assert unmatched.sum() / tokens > 1e-3  # 1000x float noise and more: the metric sees it
    assert ((unmatched - quantization).abs() <= gap + 1e-5).all()  # and it is the quantization's


@pytest.mark.parametrize(
    "dtype,per_token",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32-calibrated", "bf16-calibrated", "fp32-per_token"],
)
def test_exact_gap_is_zero_with_fp8_kv(models, dtype, per_token):
    model = models[dtype]
    scales = _scales(models[torch.float32], per_token)
    with batch_invariant.exact_mode():
        samples, gen = _generate(
            model, _prompts(5, seed=1), 3, scales, per_token, num_blocks=14, budget=16
        )
        mask, gen_logp, matched, _, n_mb = _gaps(model, samples, scales, control=False)
    assert gen.stats.preemptions > 0 and n_mb > 2  # preemption and recompute, several micro-batches
    assert torch.equal(matched * mask, gen_logp * mask)


def test_pool_refuses_default_scales_and_doubles_capacity(models):
    model = models[torch.float32]
    with pytest.raises(ValueError, match="default scales"):
        Generator(model, GenerationSettings(num_blocks=8, kv_dtype="fp8_e4m3"))
    budget = dict(kv_cache_gb=0.01, max_num_seqs=1_000_000, max_model_len=64)
    blocks = {}
    for name, kw in {
        "bf16": {},
        "fp8": dict(kv_dtype="fp8_e4m3"),
        "fp8 per token": dict(kv_dtype="fp8_e4m3", kv_scales="per_token"),
    }.items():
        gen = Generator(
            model,
            GenerationSettings(**budget, **kw),
            dtype=torch.bfloat16,
            kv_scales=_scales(model, False),
        )
        blocks[name] = gen.cache.budget_blocks
        assert gen.cache.nbytes <= 0.01e9
    assert blocks["fp8"] / blocks["bf16"] >= 1.99
    # per-token scales add 4 bytes per token and KV head to head_dim one-byte entries: 16 here
    assert blocks["fp8 per token"] / blocks["bf16"] >= 2 * 16 / (16 + 4) - 0.01


ON_TRITON = pytest.mark.skipif(
    not triton_interpreting(),
    reason="the Triton path on CPU tensors needs "
    "TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)",
)


@ON_TRITON
@pytest.mark.parametrize("per_token", [False, True], ids=["calibrated", "per_token"])
def test_matching_update_gap_on_the_triton_path(models, kernels, per_token):
    """The same with the generator's FP8 store and attention in their Triton kernels."""
    kernels("triton")
    model = models[torch.float32]
    scales = _scales(model, per_token)
    samples, _ = _generate(
        model, _prompts(3, seed=2, hi=16), 2, scales, per_token, max_tokens=6, budget=24
    )
    mask, gen_logp, matched, plain, _ = _gaps(model, samples, scales)
    gap = (matched - gen_logp).abs() * mask
    assert int(mask.sum()) == 36 and gap.max() < 1e-3 and gap.sum() / mask.sum() < 5e-6
    assert ((plain - gen_logp).abs() * mask).sum() / mask.sum() > 1e-3
