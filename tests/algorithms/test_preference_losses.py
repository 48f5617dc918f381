"""Preference losses and the reward-model loss against hand-written references."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.rl.algorithms import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceInput,
    bradley_terry_loss,
)
from tandem.rl.core.configlib import ConfigError

PC = torch.tensor([-12.0, -30.5, -7.25, -50.0])  # policy chosen, summed log-probs
PR = torch.tensor([-15.0, -28.0, -9.0, -49.0])  # policy rejected
RC = torch.tensor([-13.0, -31.0, -7.0, -52.0])  # reference chosen
RR = torch.tensor([-14.0, -29.5, -8.0, -47.5])  # reference rejected
LC = torch.tensor([10, 25, 5, 40])
LR = torch.tensor([12, 20, 9, 38])
B = PC.shape[0]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def make_input(with_ref=True):
    pc = PC.clone().requires_grad_(True)
    pr = PR.clone().requires_grad_(True)
    inp = PreferenceInput(pc, pr, RC if with_ref else None, RR if with_ref else None, LC, LR)
    return pc, pr, inp


def assert_close(got, want, tol=1e-5):
    assert torch.allclose(
        got.detach(), torch.tensor(want, dtype=torch.float32), atol=tol, rtol=tol
    ), (got, want)


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo(beta, ls):
    want, want_c, want_r = [], [], []
    for i in range(B):
        c = PC[i].item() - RC[i].item()
        r = PR[i].item() - RR[i].item()
        z = beta * (c - r)
        want.append(-(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z))
        want_c.append(beta * c)
        want_r.append(beta * r)
    pc, _, inp = make_input()
    out = PREFERENCE_LOSSES.get("dpo")(inp, PreferenceConfig(beta=beta, label_smoothing=ls))
    assert_close(out.loss, want)
    assert_close(out.chosen_rewards, want_c)
    assert_close(out.rejected_rewards, want_r)
    assert not out.chosen_rewards.requires_grad
    out.loss.sum().backward()
    # d/dpc of -log sigmoid(beta h) = -beta * sigmoid(-beta h) (for ls = 0)
    if ls == 0.0:
        h = (PC - RC) - (PR - RR)
        assert_close(pc.grad, (-beta * torch.sigmoid(-beta * h)).tolist())


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_ipo(beta):
    want = []
    for i in range(B):
        h = (PC[i].item() - RC[i].item()) - (PR[i].item() - RR[i].item())
        want.append((h - 1 / (2 * beta)) ** 2)
    _, _, inp = make_input()
    out = PREFERENCE_LOSSES.get("ipo")(inp, PreferenceConfig(beta=beta))
    assert_close(out.loss, want, tol=1e-4)


@pytest.mark.parametrize("beta,gamma,ls", [(2.0, 0.5, 0.0), (2.5, 1.0, 0.0), (2.0, 0.5, 0.1)])
def test_simpo_is_reference_free_and_length_normalised(beta, gamma, ls):
    want, want_c, want_r = [], [], []
    for i in range(B):
        c = beta * PC[i].item() / LC[i].item()
        r = beta * PR[i].item() / LR[i].item()
        z = c - r - gamma
        want.append(-(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z))
        want_c.append(c)
        want_r.append(r)
    _, _, inp = make_input(with_ref=False)
    cfg = PreferenceConfig(beta=beta, margin=gamma, label_smoothing=ls)
    out = PREFERENCE_LOSSES.get("simpo")(inp, cfg)
    assert_close(out.loss, want)
    assert_close(out.chosen_rewards, want_c)
    assert_close(out.rejected_rewards, want_r)
    _, _, with_ref = make_input(with_ref=True)
    assert torch.equal(PREFERENCE_LOSSES.get("simpo")(with_ref, cfg).loss, out.loss)


def test_reference_losses_need_reference():
    _, _, inp = make_input(with_ref=False)
    for name in ("dpo", "ipo"):
        with pytest.raises(ValueError, match="reference"):
            PREFERENCE_LOSSES.get(name)(inp, PreferenceConfig())


def test_config_validation_and_registry():
    assert PREFERENCE_LOSSES.names() == ["dpo", "ipo", "simpo"]
    with pytest.raises(ConfigError, match=r"^preference.beta: must be > 0, got 0.0$"):
        PreferenceConfig(beta=0.0)
    smoothing = r"^preference.label_smoothing: must be in \[0, 0.5\), got 0.5$"
    with pytest.raises(ConfigError, match=smoothing):
        PreferenceConfig(label_smoothing=0.5)


def test_all_losses_share_one_signature():
    _, _, inp = make_input()
    for name in PREFERENCE_LOSSES:
        out = PREFERENCE_LOSSES.get(name)(inp, PreferenceConfig())
        assert out.loss.shape == out.chosen_rewards.shape == out.rejected_rewards.shape == (B,)


def test_bradley_terry():
    chosen = torch.tensor([1.0, -0.5, 3.0, 0.0])
    rejected = torch.tensor([0.0, 0.5, -2.0, 0.0])
    want = [-log_sigmoid(c - r) for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)]
    assert_close(bradley_terry_loss(chosen, rejected), want)
    assert math.isclose(
        bradley_terry_loss(torch.zeros(1), torch.zeros(1)).item(), math.log(2), rel_tol=1e-6
    )
