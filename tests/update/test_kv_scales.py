"""FP8 KV scales that follow the policy (tandem/rl/update/kv_scales.py), on one rank.

One gloo rank, the quickstart policy as a `FlatPolicy` (FSDP2 over a one-rank mesh). The
reference for the calibration is a plain copy of the model outside FSDP2, run one sample at a
time under causal attention with a backend that records each layer's K and V; the reference
for the update's rounding is that copy with `KVQuantAttention` around causal attention.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from tandem.kernels import kv_quant as kvq
from tandem.models.attention import CausalAttention
from tandem.models.hf import load_args
from tandem.models.transformer import Transformer
from tandem.parallel.mesh import Degrees, build_mesh
from tandem.rl.config.rl_schema import RolloutConfig
from tandem.rl.core.checkpoint import CheckpointError
from tandem.rl.core.modeling import BuildSpec
from tandem.rl.rollout.types import RolloutSample
from tandem.rl.update.kv_scales import KVScales
from tandem.rl.update.policy import FlatPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    mesh = build_mesh(Degrees(), CPU)
    yield FlatPolicy(
        load_args(POLICY),
        mesh,
        CPU,
        path=POLICY,
        seed=0,
        spec=BuildSpec(),
        is_main=True,
        micro_batch_tokens=64,
        chunk_tokens=16,
    )
    dist.destroy_process_group()


def _plain(policy) -> Transformer:
    model = Transformer(policy.model.args)
    model.load_state_dict(policy.full_state())
    return model.eval()


def _samples(n: int = 10, seed: int = 0) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = (
            int(torch.randint(5, 20, (1,), generator=g)),
            int(torch.randint(2, 9, (1,), generator=g)),
        )
        out.append(
            RolloutSample(
                group=i,
                prompt_ids=torch.randint(3, 60, (p,), generator=g).tolist(),
                completion_ids=torch.randint(3, 60, (c,), generator=g).tolist(),
                loss_mask=[True] * c,
                gen_logprobs=[0.0] * c,
                finish_reason="stop",
                text="",
                row={},
            )
        )
    return out


def _reference_amax(
    model: Transformer, samples: list[RolloutSample], scales: torch.Tensor | None = None
) -> torch.Tensor:
    """Per (layer, K/V, head) amax of the samples' forwards; with ``scales`` attention reads K
    and V rounded with them (as the calibration forward does once the run has scales)."""
    a = model.args
    amax = torch.zeros(a.num_layers, 2, a.num_kv_heads)
    attend = (
        CausalAttention()
        if scales is None
        else kvq.KVQuantAttention(CausalAttention(), E4M3, scales)
    )

    def capture(layer, q, k, v):
        for i, x in enumerate((k, v)):
            amax[layer, i] = torch.maximum(amax[layer, i], x.float().abs().amax(dim=(0, 1, 3)))
        return attend(layer, q, k, v)

    with torch.no_grad():
        for s in samples:
            model(torch.tensor([s.prompt_ids + s.completion_ids[:-1]]), attn=capture)
    return amax


def _kv(**kw) -> RolloutConfig:
    return RolloutConfig(kv_dtype="fp8_e4m3", **kw)


def test_calibration_is_the_amax_of_the_policys_forward(policy):
    kv = KVScales(_kv(kv_calibration_tokens=10_000), policy.model.args)
    with pytest.raises(RuntimeError, match="never calibrated"):
        kv.scales()  # nothing samples on default scales
    samples = _samples()
    metrics = kv.calibrate(policy, samples, next_step=3)
    want = _reference_amax(_plain(policy), samples)
    torch.testing.assert_close(
        kv.amax, want, rtol=1e-5, atol=0
    )  # packed rows vs one sample: rounding only
    assert torch.equal(kv.scales(), kvq.scale_from_amax(want, E4M3))
    assert kv.step == 3 and kv.rollout_metrics(3) == {"kv/scale_age": 0.0}
    assert metrics["kv/scales_changed"] == 1.0 and metrics["kv/amax_mean"] == pytest.approx(
        float(want.mean())
    )
    # kv_calibration_tokens: only the first samples' tokens are read
    few = KVScales(_kv(kv_calibration_tokens=30), policy.model.args)
    few.calibrate(policy, samples, next_step=0)
    n = (
        next(
            i
            for i in range(len(samples))
            if sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples[: i + 1]) >= 30
        )
        + 1
    )
    torch.testing.assert_close(
        few.amax, _reference_amax(_plain(policy), samples[:n]), rtol=1e-5, atol=0
    )


def test_scales_follow_the_weights_with_a_decaying_high_water_mark(policy):
    kv = KVScales(_kv(kv_scale_decay=0.5), policy.model.args)
    samples = _samples()
    kv.calibrate(policy, samples, next_step=1)
    first, scales0 = kv.amax.clone(), kv.scales()
    attn = policy.model.layers["0"].attention
    wk = attn.k_norm.weight if attn.k_norm is not None else attn.wk.weight  # Qwen3: K is normed
    saved = wk.detach().clone()
    with torch.no_grad():
        wk.mul_(0.1)  # an "update" that shrinks layer 0's keys tenfold
    try:
        seen = _reference_amax(_plain(policy), samples, scales0)
        out = kv.calibrate(policy, samples, next_step=2)
        torch.testing.assert_close(kv.amax, torch.maximum(first * 0.5, seen), rtol=1e-5, atol=0)
        assert out["kv/scales_changed"] > 0
        assert torch.equal(
            kv.scales()[0, 0], scales0[0, 0] / 2
        )  # layer 0's K scale halves per step
        hw = kv.amax.clone()
        for step in range(3, 6):  # the mark decays towards what the new weights give
            seen = _reference_amax(_plain(policy), samples, kv.scales())
            kv.calibrate(policy, samples, next_step=step)
            hw = torch.maximum(hw * 0.5, seen)
            torch.testing.assert_close(kv.amax, hw, rtol=1e-5, atol=0)
        assert torch.equal(
            kv.scales()[0, 0], kvq.scale_from_amax(seen[0, 0], E4M3)
        )  # the new keys' own
    finally:
        with torch.no_grad():
            wk.copy_(saved)


def test_update_forward_rounds_kv_as_the_pool(policy):
    """``kv_wrap`` reaches the policy's log-prob forward: equal to the plain copy's forward with
    `KVQuantAttention` around causal attention, and different from it without."""
    kv = KVScales.create(_kv(), policy.model.args, policy)
    samples = _samples(6, seed=1)
    kv.calibrate(policy, samples, next_step=0)
    width = max(len(s.completion_ids) for s in samples)
    try:
        got = policy.logprobs(samples, width)
        policy.kv_wrap = None
        plain = policy.logprobs(samples, width)
    finally:
        policy.kv_wrap = None
    model = _plain(policy)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = model(
                ids[:, :-1], attn=kvq.KVQuantAttention(CausalAttention(), E4M3, kv.scales())
            )
        lp = (
            logits[0, len(s.prompt_ids) - 1 :]
            .log_softmax(-1)
            .gather(-1, ids[0, len(s.prompt_ids) :, None])[:, 0]
        )
        torch.testing.assert_close(got[i, : len(lp)], lp, rtol=0, atol=2e-5)
    assert (got - plain).abs().max() > 1e-3


def test_checkpointed_scales_come_back_bit_for_bit(policy):
    kv = KVScales(_kv(), policy.model.args)
    kv.calibrate(policy, _samples(), next_step=7)
    kv.amax[0, 0, 0] = 1.0 + 2.0**-23  # a value whose last bit matters
    again = KVScales(_kv(), policy.model.args)
    again.load_state_dict(json.loads(json.dumps(kv.state_dict())))  # as trainer.json holds it
    assert (
        torch.equal(again.amax, kv.amax)
        and torch.equal(again.scales(), kv.scales())
        and again.step == 7
    )


def _bad_amax(state, value):
    state["amax"][1][0][0] = value
    return state


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda s: _bad_amax(s, float("nan")), r"amax\[1, 0, 0\] = nan is not a number in"),
        (lambda s: _bad_amax(s, float("inf")), r"amax\[1, 0, 0\] = inf is not a number in"),
        (lambda s: _bad_amax(s, 1e38), r"amax\[1, 0, 0\] = 1e\+38 is not a number in"),
        (lambda s: _bad_amax(s, -1.0), r"amax\[1, 0, 0\] = -1 is not a number in \[0, 100000\]"),
        (lambda s: {**s, "amax": s["amax"][:1]}, r"amax has shape \[1, 2, \d+\], this model"),
        (lambda s: {**s, "amax": "big"}, r"not an amax table \(\w+Error\)"),
        (lambda s: {"step": 1}, r"not an amax table \(KeyError\)"),
        (lambda s: {**s, "step": "7"}, r"step is '7', not an integer"),
    ],
)
def test_checkpointed_scales_are_checked_like_weights(policy, edit, why):
    """NaN, inf, 1e38 or a wrong shape in an edited (and re-hashed) trainer.json: exit 8 in one
    line, never scales that quantize every key and value to zero."""
    kv = KVScales(_kv(), policy.model.args)
    kv.calibrate(policy, _samples(), next_step=7)
    state = edit(json.loads(json.dumps(kv.state_dict())))
    again = KVScales(_kv(), policy.model.args)
    with pytest.raises(CheckpointError, match="^checkpoint trainer.json: kv_scales: " + why) as e:
        again.load_state_dict(state)
    assert e.value.exit_status == 8 and again.step != 7


def test_auto_is_skipped_and_per_token_needs_no_calibration(policy):
    """(FP8 KV with pipeline stages is a row of the table of what composes:
    tests/config/test_composes.py.)"""
    assert KVScales.create(RolloutConfig(), policy.model.args, policy) is None
    per_token = KVScales(dataclasses.replace(_kv(), kv_scales="per_token"), policy.model.args)
    assert (
        per_token.calibrated
        and per_token.scales() is None
        and per_token.calibrate(policy, [], 0) == {}
    )


def test_tensor_parallel_ranks_take_their_own_heads(policy):
    """The update's TP rank r of 2 rounds with heads [r], the generation shard r of 2 stores with
    them; the whole tensor is the same on every rank (here: set by hand, distinct per head)."""
    args = policy.model.args.replace(num_kv_heads=4)
    kv = KVScales(_kv(), args, tp=2, tp_rank=1)
    kv.amax = torch.arange(1.0, 1.0 + args.num_layers * 2 * 4).view(args.num_layers, 2, 4) * 100
    kv.step = 0
    whole = kv.scales()
    assert whole.unique().numel() > 4  # distinct scales, so a wrong slice shows
    assert torch.equal(kv.wrap(CausalAttention()).scales, whole[:, :, 2:4])
    assert torch.equal(kv.for_heads(2, 1), whole[:, :, 2:4]) and torch.equal(
        kv.for_heads(4, 0), whole[:, :, :1]
    )
