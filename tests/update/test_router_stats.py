"""Routing parity between rollout and update, exact on CPU, and the `moe/*` statistics.

A tiny random MoE (debug-qwen3-moe, fp32) samples with the paged generator (n = 4 per
prompt sharing the prompt's KV blocks; in one case a pool so small that sequences are
preempted and recomputed); the generator files each token's experts
(tandem/rl/generator/routing.py). The same sequences are then recomputed the way the update
does (packed micro-batches, `recompute_logprobs` with `RoutingCheck.observe` after each
forward), with and without ``rl.exact``'s batch-invariant kernels. Every (token, layer)
pair the rollout recorded is compared; none may differ. Two controls show the check
counts what it should: experts altered in the recorded routing, and a recompute model
whose last router has two experts' rows swapped (its choices are then the recorded ones
relabelled, so the expected count follows from the recorded routing alone).
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from tandem.kernels import batch_invariant
from tandem.models import Transformer, get_flavor
from tandem.rl.generator.engine import GenerationSettings, Generator
from tandem.rl.generator.sequence import SamplingParams
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.loss import completion_tensors, recompute_logprobs
from tandem.rl.update.packing import pack_micro_batches
from tandem.rl.update.router_stats import RouterStats, RoutingCheck

CPU = torch.device("cpu")
CASES = {  # name -> (generator settings, share_prompts in the update's packing)
    "packed": (dict(num_blocks=256, max_num_batched_tokens=64), False),
    "shared_prompts": (dict(num_blocks=256, max_num_batched_tokens=64), True),
    "preemption": (dict(num_blocks=20, max_num_batched_tokens=16), False),
}


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(get_flavor("debug-qwen3-moe"))
    m.init_weights(seed=0)  # N(0, 0.02) routers: scores close together, a hard case for parity
    return m.eval()


def _rollout(model: Transformer, settings: dict) -> tuple[list[RolloutSample], int]:
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 500, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(6)
    ]
    gen = Generator(
        model, GenerationSettings(block_size=4, max_num_seqs=32, max_model_len=64, **settings)
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=100 * i)
        for i in range(6)
    ]
    out = gen.generate(prompts, params, n=4)
    samples = [
        RolloutSample(
            group=i,
            prompt_ids=p,
            completion_ids=c.token_ids,
            loss_mask=c.sampled_mask,
            gen_logprobs=c.raw_logprobs,
            finish_reason=c.finish_reason,
            text="",
            row={},
            routing=c.routing,
        )
        for i, (p, comps) in enumerate(zip(prompts, out))
        for c in comps
    ]
    return samples, gen.stats.preemptions


def _check(
    model: Transformer, samples: list[RolloutSample], share: bool
) -> tuple[dict, int, float]:
    """RoutingCheck's metrics over the update's recomputation, its micro-batches, and the
    largest log-prob difference between the phases."""
    check = RoutingCheck()
    check.arm(samples)
    mbs = pack_micro_batches(samples, list(range(len(samples))), 90, CPU, share_prompts=share)
    mask, gen_logp, width = completion_tensors(samples, CPU)
    logp = recompute_logprobs(
        model, samples, mbs, width, CPU, chunk_tokens=7, after=lambda mb: check.observe(model, mb)
    )
    return check.metrics(None, CPU), len(mbs), float(((logp - gen_logp).abs() * mask).max())


def _recorded_pairs(samples: list[RolloutSample]) -> int:
    """(token, layer) pairs the rollout recorded (rows of -1: computed once for another
    group member)."""
    return sum(int((s.routing[..., 0] >= 0).sum()) for s in samples)


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("case", list(CASES))
def test_rollout_and_update_route_every_token_alike(model, case, exact):
    settings, share = CASES[case]
    with batch_invariant.exact_mode() if exact else contextlib.nullcontext():
        samples, preempted = _rollout(model, settings)
        got, n_mb, gap = _check(model, samples, share)
    assert all(
        s.routing.shape == (len(s.completion_ids), 2, 2) and s.routing.dtype == torch.int16
        for s in samples
    )
    assert n_mb > 2 and (preempted > 0) == (case == "preemption")
    # every sample's every input recorded (the last prompt token runs once per group member):
    # 6 prompts x 4 samples x 12 tokens x 2 layers
    assert _recorded_pairs(samples) == 6 * 4 * 12 * 2
    assert got == {"moe/routing_mismatch": 0.0, "moe/routing_compared": 6 * 4 * 12 * 2}
    # the phases' numerics: equal bits with rl.exact, last-bit differences without, which the
    # routing survives here (measured: no mismatch either way)
    assert gap == 0.0 if exact else 0.0 < gap < 1e-4, gap


def test_altered_recorded_experts_are_counted_one_by_one(model):
    samples, _ = _rollout(model, CASES["packed"][0])
    pairs = _recorded_pairs(samples)
    for s, token, layer in ((samples[0], 0, 0), (samples[5], 3, 1), (samples[17], 7, 0)):
        row = s.routing[token, layer]
        unused = next(e for e in range(8) if e not in row.tolist())
        s.routing[token, layer] = torch.sort(
            torch.tensor([row[0].item(), unused], dtype=torch.int16)
        ).values
    got = _check(model, samples, share=False)[0]
    assert got == {"moe/routing_mismatch": 3 / pairs, "moe/routing_compared": float(pairs)}


def test_swapped_router_rows_change_exactly_the_predicted_pairs(model):
    """The recompute model's last router with experts 2 and 5 swapped: its layer-0 choices stay,
    its layer-1 choices are the recorded ones relabelled 2 <-> 5, which differ as sets exactly
    where the recorded pair holds one of the two."""
    samples, _ = _rollout(model, CASES["packed"][0])
    swapped = copy.deepcopy(model)
    with torch.no_grad():
        w = swapped.layers["1"].moe.gate.weight
        w[[2, 5]] = w[[5, 2]].clone()
    want = 0
    for s in samples:
        rows = s.routing[:, 1]  # [C, k] layer 1
        recorded = rows[:, 0] >= 0
        want += int(((rows == 2).any(-1) ^ (rows == 5).any(-1))[recorded].sum())
    pairs = _recorded_pairs(samples)
    got = _check(swapped, samples, share=False)[0]
    assert want > 20
    assert got == {"moe/routing_mismatch": want / pairs, "moe/routing_compared": float(pairs)}


def test_router_stats_metrics_equal_hand_computed_values():
    """Two observed forwards of a 2-layer model (keys "2" and "10": ordered as numbers)."""

    def block(counts: list[int], aux: float, z: float) -> SimpleNamespace:
        return SimpleNamespace(
            tokens_per_expert=torch.tensor(counts),
            aux_loss=torch.tensor(aux),
            z_loss=torch.tensor(z),
        )

    def model(a: SimpleNamespace, b: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(
            layers={
                "2": SimpleNamespace(moe=a),
                "10": SimpleNamespace(moe=b),
                "11": SimpleNamespace(moe=None),
            }
        )  # a dense layer

    stats = RouterStats()
    stats.observe(model(block([3, 1, 0, 4], 1.0, 10.0), block([2, 2, 2, 2], 2.0, 20.0)))
    stats.observe(model(block([1, 1, 2, 0], 3.0, 30.0), block([0, 8, 0, 0], 6.0, 60.0)))
    got = stats.metrics(None, CPU)
    assert got == pytest.approx(
        {
            "moe/expert_load_max_over_mean/2": 4 / 3,  # [4, 2, 2, 4]: max 4, mean 3
            "moe/expert_load_max_over_mean/10": 10 / 4,  # [2, 10, 2, 2]: max 10, mean 4
            "moe/aux_loss": (1 + 2 + 3 + 6) / 4,  # mean over layers and forwards
            "moe/z_loss": (10 + 20 + 30 + 60) / 4,
        },
        rel=1e-12,
    )
    assert stats.metrics(None, CPU) == {}  # started over
