"""Off-policy corrections (tandem/rl/algorithms/offpolicy.py) against hand-computed values on
fixed tensors: each weight written out token by token with ``math``."""

import math
import os

import pytest
import torch

from tandem.rl.algorithms import (
    OFFPOLICY_CORRECTIONS,
    POLICY_LOSSES,
    CorrectionConfig,
    CorrectionInput,
    PolicyLossConfig,
    PolicyLossInput,
    m2po_keep,
)
from tandem.rl.config.schema import ConfigError, load_config

# two sequences of 4 tokens, the second 3 long
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
BEHAV = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.5, -0.7, 0.0]])
PROX = torch.tensor([[-0.4, -0.9, -1.9, -0.1], [-0.3, -0.2, -1.4, 0.0]])
CUR = torch.tensor([[-0.35, -0.8, -2.0, -0.05], [-0.25, -0.3, -1.3, 0.0]])
VERSIONS = torch.tensor([[3, 3, 4, 5], [5, 5, 5, 0]])  # trained at version 5
LIVE = [(i, t) for i in range(2) for t in range(4) if MASK[i, t]]


def _inp(**kw):
    return CorrectionInput(
        logp=CUR, prox_logp=PROX, behav_logp=BEHAV, mask=MASK, versions=VERSIONS, version=5, **kw
    )


def _weights(name, **cfg):
    out = OFFPOLICY_CORRECTIONS.get(name)(_inp(), CorrectionConfig(**cfg))
    return out.old_logp, out.weight


def _rho(i, t):
    return math.exp(PROX[i, t].item() - BEHAV[i, t].item())


def _seq_rho(i):
    return math.exp(sum(PROX[i, t].item() - BEHAV[i, t].item() for t in range(4) if MASK[i, t]))


def _check(weight, want):
    for i, t in LIVE:
        assert math.isclose(weight[i, t].item(), want(i, t), rel_tol=1e-6), (i, t)


def test_none_keeps_the_loss_as_written():
    old, w = _weights("none")
    assert torch.equal(old, PROX) and torch.equal(w, torch.ones_like(w))


@pytest.mark.parametrize("cap", [1.5, 4.0])
def test_tis_truncates_the_token_and_the_sequence_ratio(cap):
    old, w = _weights("tis", cap=cap)
    assert torch.equal(old, PROX)
    _check(w, lambda i, t: min(_rho(i, t), cap))
    _, w = _weights("tis", cap=cap, level="sequence")
    _check(w, lambda i, t: min(_seq_rho(i), cap))


@pytest.mark.parametrize("cap", [1.5, 4.0])
def test_mis_drops_the_tokens_and_the_sequences_above_the_cap(cap):
    _, w = _weights("mis", cap=cap)
    _check(w, lambda i, t: _rho(i, t) if _rho(i, t) <= cap else 0.0)
    assert (w * MASK == 0).any()  # some token was above the cap
    _, w = _weights("mis", cap=cap, level="sequence")
    _check(w, lambda i, t: _seq_rho(i) if _seq_rho(i) <= cap else 0.0)


def test_decoupled_with_a_recomputed_and_a_loglinear_proximal_policy():
    old, w = _weights("decoupled", cap=2.0)
    assert torch.equal(old, PROX)
    _check(w, lambda i, t: min(_rho(i, t), 2.0))
    _, w = _weights("decoupled", cap=None)
    _check(w, lambda i, t: _rho(i, t))

    def prox(i, t):  # AReaL's log-linear proximal policy, by versions
        vb = VERSIONS[i, t].item()
        alpha = (5 - vb) / (6 - vb)
        return BEHAV[i, t].item() + alpha * (CUR[i, t].item() - BEHAV[i, t].item())

    old, w = _weights("decoupled", cap=None, proximal="loglinear")
    _check(old, prox)
    assert torch.equal(old[1, :3], BEHAV[1, :3])  # tokens of the trained version: alpha = 0
    _check(w, lambda i, t: math.exp(prox(i, t) - BEHAV[i, t].item()))


def test_m2po_drops_the_largest_second_moments_until_the_mean_is_below_the_threshold():
    m2 = torch.tensor([[0.09, 0.16, 0.01, 0.0], [0.0, 1.69, 0.49, 5.0]])  # (prox - behav)^2
    # sorted over the 7 trained tokens: 1.69 0.49 0.16 0.09 0.01 0 0; the means of what is left
    # after dropping the k largest: 2.44/7, 0.75/6, 0.26/5 = 0.052, 0.1/4 = 0.025
    keep = m2po_keep(m2, MASK, threshold=0.04)
    assert keep.tolist() == [[True, False, True, True], [True, False, False, False]]
    assert m2po_keep(m2, MASK, threshold=10.0).tolist() == MASK.bool().tolist()  # nothing to drop
    split = m2po_keep(m2[:1], MASK[:1], 0.04, gather=lambda t: torch.cat([t, m2[1, :3].double()]))
    assert split.tolist() == keep[:1].tolist()  # the same cut with the tokens on two ranks
    inp = _inp(keep=keep)
    out = OFFPOLICY_CORRECTIONS.get("m2po")(inp, CorrectionConfig(m2_threshold=0.04))
    _check(out.weight, lambda i, t: _rho(i, t) if keep[i, t] else 0.0)


def test_tis_in_the_loss_equals_the_truncated_ppo_loss_written_out():
    """The default correction reproduces PPO with truncated IS on the train/generation gap:
    per token ``max(-A r, -A clip(r)) * min(exp(old - gen), C)``, ``r = exp(cur - old)``."""
    adv = torch.tensor([[1.0, -1.0, 0.5, 2.0], [-0.5, 1.0, -2.0, 0.0]])
    corr = OFFPOLICY_CORRECTIONS.get("tis")(_inp(), CorrectionConfig(cap=1.2))
    out = POLICY_LOSSES.get("ppo_clip")(
        PolicyLossInput(CUR, corr.old_logp, adv, MASK), PolicyLossConfig()
    )
    loss = out.loss * corr.weight
    for i, t in LIVE:
        r = math.exp(CUR[i, t].item() - PROX[i, t].item())
        a = adv[i, t].item()
        want = max(-a * r, -a * min(max(r, 0.8), 1.2)) * min(_rho(i, t), 1.2)
        assert math.isclose(loss[i, t].item(), want, rel_tol=1e-6, abs_tol=1e-9), (i, t)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["rl.proximal=loglinear"],
            "rl.proximal: not used by rl.offpolicy_correction = 'tis' "
            "(it reads rl.tis_cap, rl.offpolicy_level)",
        ),
        (
            ["rl.offpolicy_correction=m2po", "rl.offpolicy_level=sequence"],
            "rl.offpolicy_level: not used by rl.offpolicy_correction = 'm2po' "
            "(it reads rl.proximal, rl.m2_threshold)",
        ),
        (
            ["rl.offpolicy_correction=mis", "rl.tis_cap=none"],
            "rl.tis_cap: none, but rl.offpolicy_correction = 'mis' needs a cap "
            "(set rl.offpolicy_correction = 'none' for no correction)",
        ),
    ],
)
def test_a_correction_setting_the_correction_does_not_read_is_one_config_line(override, message):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(root, "configs", "quickstart.toml"), override)
    assert str(e.value) == message
