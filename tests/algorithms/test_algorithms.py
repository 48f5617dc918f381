"""Algorithm registries against hand-written loop references on small fixed tensors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tandem.rl.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageConfig,
    AdvantageInput,
    AggregationNorm,
    PolicyLossConfig,
    PolicyLossInput,
    dense_group_index,
    entropy_loss,
    filter_groups,
    kl_loss_term,
    kl_penalty_rewards,
    make_norm,
    overlong_filter_mask,
    overlong_penalty,
    value_loss,
)
from tandem.rl.config.rl_schema import RLConfig
from tandem.rl.config.schema import load_config
from tandem.rl.core.configlib import ConfigError
from tandem.rl.core.registry import RegistryError

# 8 responses, 5 positions; right padding, row 6 has a hole (a tool-output token), row 7 is empty.
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0],
    ],
    dtype=torch.float32,
)
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5, 2.0, 2.0, -1.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 1, 0, 2, 2, 3])  # interleaved; group 3 has one member
TOKEN_REWARDS = torch.tensor(
    [
        [0.1, -0.2, 0.05, 9.0, 9.0],
        [0.0, 0.1, 0.1, -0.1, 0.2],
        [-0.3, 9.0, 9.0, 9.0, 9.0],
        [0.2, 0.0, -0.1, 0.1, 9.0],
        [0.05, 0.05, 9.0, 9.0, 9.0],
        [0.1, 0.1, 0.1, 0.1, 0.1],
        [0.2, 9.0, -0.2, 0.3, 9.0],
        [9.0, 9.0, 9.0, 9.0, 9.0],
    ]
)  # 9.0 sits on masked-out positions and must never count
VALUES = torch.tensor(
    [
        [0.5, 0.4, 0.3, 7.0, 7.0],
        [0.1, 0.2, 0.3, 0.4, 0.5],
        [0.9, 7.0, 7.0, 7.0, 7.0],
        [0.0, -0.1, 0.2, 0.3, 7.0],
        [1.0, 1.5, 7.0, 7.0, 7.0],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [-0.5, 7.0, 0.1, 0.4, 7.0],
        [7.0, 7.0, 7.0, 7.0, 7.0],
    ]
)
N, T = MASK.shape


def rows(mask=MASK):
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


def assert_close(got, want, tol=1e-5):
    want = torch.as_tensor(want, dtype=torch.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got, want)


def broadcast(per_seq):
    out = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        for t in ts:
            out[i, t] = per_seq[i]
    return out


def seq_rewards(with_tokens):
    r = SCORES.tolist()
    if with_tokens:
        for i, ts in enumerate(rows()):
            r[i] += sum(TOKEN_REWARDS[i, t].item() for t in ts)
    return r


def members(i):
    return [j for j in range(N) if GROUPS[j] == GROUPS[i]]


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("with_tokens", [False, True])
def test_grpo(norm_by_std, with_tokens):
    r = seq_rewards(with_tokens)
    eps = 1e-6
    want = []
    for i in range(N):
        xs = [r[j] for j in members(i)]
        mean = sum(xs) / len(xs)
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        want.append((r[i] - mean) / (std + eps) if norm_by_std else r[i] - mean)
    inp = AdvantageInput(SCORES, MASK, GROUPS, TOKEN_REWARDS if with_tokens else None)
    out = ADVANTAGES.get("grpo")(inp, AdvantageConfig(norm_by_std=norm_by_std, eps=eps))
    assert out.returns is None
    assert_close(out.advantages, broadcast(want), tol=1e-4)


def test_dr_grpo_ignores_std():
    want = []
    for i in range(N):
        xs = [SCORES[j].item() for j in members(i)]
        want.append(SCORES[i].item() - sum(xs) / len(xs))
    out = ADVANTAGES.get("dr_grpo")(
        AdvantageInput(SCORES, MASK, GROUPS), AdvantageConfig(norm_by_std=True)
    )
    assert_close(out.advantages, broadcast(want))


def test_rloo():
    want = []
    for i in range(N):
        others = [SCORES[j].item() for j in members(i) if j != i]
        want.append(SCORES[i].item() - sum(others) / len(others) if others else 0.0)
    out = ADVANTAGES.get("rloo")(AdvantageInput(SCORES, MASK, GROUPS), AdvantageConfig())
    assert_close(out.advantages, broadcast(want))


def test_group_ids_can_be_sparse_after_densify():
    sparse = GROUPS * 1000 + 17  # prompt uids
    dense = dense_group_index(sparse)
    a = ADVANTAGES.get("grpo")(AdvantageInput(SCORES, MASK, dense), AdvantageConfig()).advantages
    b = ADVANTAGES.get("grpo")(AdvantageInput(SCORES, MASK, GROUPS), AdvantageConfig()).advantages
    assert_close(a, b)


def token_returns_reference(gamma):
    """Per-token rewards (score at the last masked token) and discounted returns, by loops."""
    ret = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        running = 0.0
        for t in reversed(ts):
            r = TOKEN_REWARDS[i, t].item() + (SCORES[i].item() if t == ts[-1] else 0.0)
            running = r + gamma * running
            ret[i, t] = running
    return ret


def whiten_reference(x, eps, scale=True):
    vals = [x[i, t].item() for i, ts in enumerate(rows()) for t in ts]
    mean = sum(vals) / len(vals)
    std = statistics.stdev(vals)
    out = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        for t in ts:
            out[i, t] = (x[i, t].item() - mean) / (std + eps) if scale else x[i, t].item() - mean
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_reinforce_pp(gamma, norm_by_std):
    ret = token_returns_reference(gamma)
    cfg = AdvantageConfig(gamma=gamma, norm_by_std=norm_by_std)
    out = ADVANTAGES.get("reinforce_pp")(AdvantageInput(SCORES, MASK, None, TOKEN_REWARDS), cfg)
    assert_close(out.returns, ret)
    assert_close(out.advantages, whiten_reference(ret, cfg.eps, scale=norm_by_std), tol=1e-4)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
@pytest.mark.parametrize("whiten", [False, True])
def test_gae(gamma, lam, whiten):
    adv = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        last_gae, next_v = 0.0, 0.0
        for t in reversed(ts):
            r = TOKEN_REWARDS[i, t].item() + (SCORES[i].item() if t == ts[-1] else 0.0)
            v = VALUES[i, t].item()
            last_gae = r + gamma * next_v - v + gamma * lam * last_gae
            next_v = v
            adv[i, t] = last_gae
    returns = (adv + VALUES) * MASK
    cfg = AdvantageConfig(gamma=gamma, lam=lam, whiten=whiten)
    out = ADVANTAGES.get("gae")(AdvantageInput(SCORES, MASK, None, TOKEN_REWARDS, VALUES), cfg)
    assert_close(out.returns, returns)
    assert_close(out.advantages, whiten_reference(adv, cfg.eps) if whiten else adv, tol=1e-4)


def test_gae_lambda1_gamma1_is_return_minus_value():
    cfg = AdvantageConfig(gamma=1.0, lam=1.0, whiten=False)
    out = ADVANTAGES.get("gae")(AdvantageInput(SCORES, MASK, None, TOKEN_REWARDS, VALUES), cfg)
    assert_close(out.advantages, (token_returns_reference(1.0) - VALUES) * MASK)


def test_advantage_errors():
    with pytest.raises(ValueError, match="group_index"):
        ADVANTAGES.get("grpo")(AdvantageInput(SCORES, MASK), AdvantageConfig())
    with pytest.raises(ValueError, match="values"):
        ADVANTAGES.get("gae")(AdvantageInput(SCORES, MASK), AdvantageConfig())
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(RegistryError, match="did you mean 'grpo'"):
        ADVANTAGES.get("gpro")


# ---------------------------------------------------------------- policy losses

LOGP = torch.tensor(
    [
        [-1.0, -0.5, -2.0, -3.0, -3.0],
        [-0.2, -0.9, -1.1, -0.4, -0.7],
        [-0.1, -1.0, -1.0, -1.0, -1.0],
        [-2.5, -0.3, -0.8, -1.2, -1.0],
        [-0.6, -0.6, -1.0, -1.0, -1.0],
        [-1.5, -0.05, -0.3, -2.2, -0.9],
        [-0.4, -1.0, -0.2, -1.3, -1.0],
        [-1.0, -1.0, -1.0, -1.0, -1.0],
    ]
)
OLD_LOGP = LOGP + torch.tensor(
    [
        [0.0, 0.5, -0.4, 0.0, 0.0],
        [0.1, -0.1, 0.3, -1.5, 0.02],
        [-1.2, 0.0, 0.0, 0.0, 0.0],
        [0.05, -0.25, 0.9, 0.0, 0.0],
        [0.2, -0.2, 0.0, 0.0, 0.0],
        [-0.01, 0.01, 0.15, -0.15, 0.3],
        [0.4, 0.0, -0.3, 0.1, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]
)  # log(old/new) per token; ratios range over both clip edges
ADV_SEQ = [1.0, -1.0, 0.5, -2.0, 2.0, 0.3, -0.7, 0.0]
ADV = broadcast(ADV_SEQ)


def policy_input(**kw):
    logp = LOGP.clone().requires_grad_(True)
    return logp, PolicyLossInput(logp, OLD_LOGP, ADV, MASK, **kw)


@pytest.mark.parametrize(
    "clip_low,clip_high,dual",
    [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, 0.2, 1.5)],
)
def test_ppo_clip(clip_low, clip_high, dual):
    want_loss, want_grad, want_clip = torch.zeros(N, T), torch.zeros(N, T), torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        for t in ts:
            a = ADV[i, t].item()
            r = math.exp(LOGP[i, t].item() - OLD_LOGP[i, t].item())
            unclipped, clipped = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
            loss, grad, was_clipped = unclipped, -a * r, False  # d(-a r)/d logp = -a r
            if clipped > unclipped:
                loss, grad, was_clipped = clipped, 0.0, True
            if dual is not None and a < 0 and loss > -a * dual:
                loss, grad, was_clipped = -a * dual, 0.0, True
            want_loss[i, t], want_grad[i, t], want_clip[i, t] = loss, grad, float(was_clipped)
    logp, inp = policy_input()
    cfg = PolicyLossConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual)
    out = POLICY_LOSSES.get("ppo_clip")(inp, cfg)
    assert_close(out.loss, want_loss)
    assert_close(out.metrics["clipped"], want_clip)
    out.loss.sum().backward()
    assert_close(logp.grad, want_grad)
    ratio = (LOGP - OLD_LOGP).exp() * MASK
    assert_close(out.metrics["ratio"], ratio)
    assert_close(out.metrics["approx_kl"], (ratio - 1 - (LOGP - OLD_LOGP)) * MASK)
    assert (out.metrics["approx_kl"] >= 0).all()


@pytest.mark.parametrize("lo,hi", [(3e-4, 4e-4), (0.05, 0.1), (0.5, 0.5)])
def test_gspo_token_form(lo, hi):
    want_loss, want_grad = torch.zeros(N, T), torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        if not ts:
            continue
        s = math.exp(sum(LOGP[i, t].item() - OLD_LOGP[i, t].item() for t in ts) / len(ts))
        a = ADV_SEQ[i]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        for t in ts:
            want_loss[i, t] = max(unclipped, clipped)
            # token form: s_i * grad log p_t
            want_grad[i, t] = 0.0 if clipped > unclipped else -a * s
    logp, inp = policy_input()
    cfg = PolicyLossConfig(seq_clip_low=lo, seq_clip_high=hi)
    out = POLICY_LOSSES.get("gspo")(inp, cfg)
    assert_close(out.loss, want_loss)
    out.loss.sum().backward()
    assert_close(logp.grad, want_grad)


def test_gspo_token_form_matches_sequence_objective():
    """Sequence advantages + seq_mean_token_mean: gradient equals the paper's sequence-level
    objective."""
    lo, hi = 0.05, 0.1
    logp, inp = policy_input()
    cfg = PolicyLossConfig(seq_clip_low=lo, seq_clip_high=hi)
    out = POLICY_LOSSES.get("gspo")(inp, cfg)
    AGGREGATIONS.get("seq_mean_token_mean")(out.loss, MASK, make_norm(MASK)).backward()

    ref = LOGP.clone().requires_grad_(True)
    terms = []
    for i, ts in enumerate(rows()):
        if not ts:
            continue
        s = torch.stack([ref[i, t] - OLD_LOGP[i, t] for t in ts]).mean().exp()
        a = ADV_SEQ[i]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi)))
    (sum(terms) / len(terms)).backward()
    assert_close(logp.grad, ref.grad)


def test_reinforce():
    logp, inp = policy_input()
    out = POLICY_LOSSES.get("reinforce")(inp, PolicyLossConfig())
    want = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        for t in ts:
            want[i, t] = -ADV[i, t].item() * LOGP[i, t].item()
    assert_close(out.loss, want)
    out.loss.sum().backward()
    assert_close(logp.grad, -ADV * MASK)


def test_padding_cannot_poison_the_loss():
    logp = LOGP.masked_fill(MASK == 0, float("-inf"))
    for name in POLICY_LOSSES:
        no_tis = PolicyLossConfig()
        out = POLICY_LOSSES.get(name)(PolicyLossInput(logp, OLD_LOGP, ADV, MASK), no_tis)
        assert torch.isfinite(out.loss).all(), name
        assert all(torch.isfinite(v).all() for v in out.metrics.values()), name


def test_policy_config_validation():
    """One check of the clip settings, here and for the [rl] section that extends the class."""
    with pytest.raises(ConfigError, match=r"^rl.dual_clip: must be > 1, got 0.5$"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ConfigError, match="rl.clip_low"):
        PolicyLossConfig(clip_low=-0.1)
    with pytest.raises(ConfigError, match=r"^rl.tis_cap: must be > 0, got 0.0$"):
        load_config("configs/quickstart.toml", ["--rl.tis_cap=0"])
    assert issubclass(RLConfig, PolicyLossConfig) and RLConfig().clip_high == 0.2


def test_gspo_clip_range_reaches_the_loss():
    """A wider sequence clip range clips fewer tokens of the same batch."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.01
    old = logp + torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.01
    inp = PolicyLossInput(
        logp=logp,
        old_logp=old,
        advantages=torch.ones(4, 5, dtype=torch.float64),
        mask=torch.ones(4, 5, dtype=torch.float64),
    )
    fracs = []
    for lo, hi in ((3e-4, 4e-4), (0.5, 0.5)):
        keys = ["--rl.policy_loss=gspo", f"--rl.seq_clip_low={lo}", f"--rl.seq_clip_high={hi}"]
        cfg = load_config("configs/quickstart.toml", keys)
        out = POLICY_LOSSES.get("gspo")(inp, cfg.rl)
        fracs.append(out.metrics["clipped"].mean().item())
    assert fracs[0] > 0 and fracs[1] == 0


# ---------------------------------------------------------------- KL

# 15 exercises the k3 clamp
REF_LOGP = LOGP + torch.tensor([[0.3, -0.2, 15.0, 0.0, 0.0]]).expand(N, T)


def test_kl_estimators():
    fns = {
        "k1": lambda lp, rl: lp - rl,
        "k2": lambda lp, rl: 0.5 * (lp - rl) ** 2,
        "k3": lambda lp, rl: (
            math.exp(max(min(rl - lp, 10.0), -10.0)) - max(min(rl - lp, 10.0), -10.0) - 1
        ),
    }
    assert KL_ESTIMATORS.names() == sorted(fns)
    for name, ref in fns.items():
        got = KL_ESTIMATORS.get(name)(LOGP, REF_LOGP)
        want = [[ref(LOGP[i, t].item(), REF_LOGP[i, t].item()) for t in range(T)] for i in range(N)]
        assert_close(got, want, tol=1e-4)
    assert torch.isfinite(KL_ESTIMATORS.get("k3")(LOGP, LOGP + 1e4)).all()
    assert (KL_ESTIMATORS.get("k3")(LOGP, REF_LOGP) >= 0).all()


def test_kl_modes():
    logp = LOGP.clone().requires_grad_(True)
    pen = kl_penalty_rewards(logp, REF_LOGP, MASK, beta=0.05, estimator="k1")
    assert not pen.requires_grad
    assert_close(pen, -0.05 * (LOGP - REF_LOGP) * MASK)
    term = kl_loss_term(logp, REF_LOGP, MASK, beta=0.05, estimator="k2")
    term.sum().backward()
    assert_close(logp.grad, 0.05 * (LOGP - REF_LOGP) * MASK)


# ---------------------------------------------------------------- aggregation

LOSS = torch.tensor(
    [
        [0.5, -1.0, 2.0, 9.0, 9.0],
        [0.1, 0.2, 0.3, 0.4, 0.5],
        [-3.0, 9.0, 9.0, 9.0, 9.0],
        [1.0, 1.0, -2.0, 0.5, 9.0],
        [0.7, -0.7, 9.0, 9.0, 9.0],
        [0.0, 0.25, 0.5, 0.75, 1.0],
        [2.0, 9.0, -1.0, 0.5, 9.0],
        [9.0, 9.0, 9.0, 9.0, 9.0],
    ]
)
L_MAX = 6.0


def aggregation_reference(mode):
    seqs = [(i, ts) for i, ts in enumerate(rows()) if ts]
    sums = [sum(LOSS[i, t].item() for t in ts) for i, ts in seqs]
    lens = [len(ts) for _, ts in seqs]
    return {
        "token_mean": sum(sums) / sum(lens),
        "seq_mean_token_sum": sum(sums) / len(seqs),
        "seq_mean_token_mean": sum(s / n for s, n in zip(sums, lens, strict=True)) / len(seqs),
        "seq_mean_token_sum_norm": sum(s / L_MAX for s in sums) / len(seqs),
    }[mode]


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_aggregation_full_batch(mode):
    got = AGGREGATIONS.get(mode)(LOSS, MASK, make_norm(MASK, constant=L_MAX))
    assert math.isclose(got.item(), aggregation_reference(mode), rel_tol=1e-5)


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("sizes", [[8], [3, 1, 4], [1, 1, 2, 4], [5, 3]])
def test_aggregation_is_layout_invariant(mode, sizes):
    """Micro-batches of different sizes (each trimmed to its own padded length) sum to the
    full batch."""
    agg = AGGREGATIONS.get(mode)
    weights = torch.linspace(0.5, 1.5, N * T).reshape(N, T)  # a differentiable loss

    full_w = weights.clone().requires_grad_(True)
    full = agg(LOSS * full_w, MASK, make_norm(MASK, constant=L_MAX))
    full.backward()

    split_w = weights.clone().requires_grad_(True)
    chunks = []
    start = 0
    for n in sizes:
        m = MASK[start : start + n]
        used = m.sum(0).nonzero()
        width = int(used.max()) + 1 if len(used) else 1
        chunks.append((slice(start, start + n), width))
        start += n
    norm = make_norm([MASK[s, :w] for s, w in chunks], constant=L_MAX)
    total = torch.zeros(())
    for s, w in chunks:
        part = agg((LOSS * split_w)[s, :w], MASK[s, :w], norm)
        part.backward()
        total = total + part.detach()
    assert math.isclose(total.item(), full.item(), rel_tol=1e-5, abs_tol=1e-6)
    assert_close(split_w.grad, full_w.grad)


def test_make_norm_counts_and_constant():
    norm = make_norm([MASK[:3], MASK[3:]])
    assert norm.global_tokens.item() == MASK.sum().item()
    assert norm.global_seqs.item() == 7  # the empty row does not count
    with pytest.raises(ValueError, match="constant"):
        AGGREGATIONS.get("seq_mean_token_sum_norm")(LOSS, MASK, norm)
    plain = AggregationNorm(global_tokens=float(MASK.sum()), global_seqs=7.0)
    assert torch.allclose(
        AGGREGATIONS.get("token_mean")(LOSS, MASK, plain),
        AGGREGATIONS.get("token_mean")(LOSS, MASK, norm),
    )


def test_entropy_loss():
    ent = LOSS.abs()
    norm = make_norm(MASK)
    got = entropy_loss(ent, MASK, "token_mean", norm, coef=0.01)
    vals = [ent[i, t].item() for i, ts in enumerate(rows()) for t in ts]
    assert math.isclose(got.item(), -0.01 * sum(vals) / len(vals), rel_tol=1e-5)


# ---------------------------------------------------------------- filters, value


def test_filter_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 2.5, 3.0])
    keep = filter_groups(scores, GROUPS)
    want = []
    for i in range(N):
        xs = [scores[j].item() for j in members(i)]
        want.append(max(xs) != min(xs))
    assert keep.tolist() == want
    assert keep.tolist() == [False, False, False, False, False, True, True, False]
    assert filter_groups(
        torch.tensor([1.0, 1.05, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), atol=0.1
    ).tolist() == [False, False, True, True]


def test_overlong():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    max_len, buffer_len, factor = 20, 4, 0.5
    want = []
    for n in lengths.tolist():
        if n <= max_len - buffer_len:
            want.append(0.0)
        elif n <= max_len:
            want.append(-factor * (n - (max_len - buffer_len)) / buffer_len)
        else:
            want.append(-factor)
    assert_close(overlong_penalty(lengths, max_len, buffer_len, factor), want)
    assert overlong_filter_mask(torch.tensor([True, False, True])).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip):
    old = VALUES
    values = (VALUES + torch.linspace(-0.5, 0.5, N * T).reshape(N, T)).requires_grad_(True)
    returns = VALUES + 0.3
    want = torch.zeros(N, T)
    for i, ts in enumerate(rows()):
        for t in ts:
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            loss = (v - r) ** 2
            if clip is not None:
                loss = max(loss, (o + min(max(v - o, -clip), clip) - r) ** 2)
            want[i, t] = 0.5 * loss
    got = value_loss(values, old, returns, MASK, clip)
    assert_close(got, want)
    got.sum().backward()
    assert (values.grad[MASK == 0] == 0).all()
