"""Offline preference losses (pairs of chosen / rejected responses) and the reward-model loss.

Registry ``PREFERENCE_LOSSES``; every entry has the signature
``fn(inp: PreferenceInput, cfg: PreferenceConfig) -> PreferenceOutput``, all
``[B]`` per pair (aggregate with a mean over the pairs of the step). Log-probs are
SUMMED over each response's tokens; losses that want a per-token average divide
by the lengths themselves. ``chosen_rewards`` / ``rejected_rewards`` are the
detached implicit rewards, for metrics (reward margin, accuracy).

Config defaults (beta=0.1, margin=0.5) are DPO's beta and SimPO's gamma. SimPO's
beta is on a length-normalised log-prob, a much smaller scale, so the SimPO paper
uses beta around 2.0-2.5; a SimPO run must set beta itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from tandem.rl.core.configlib import require
from tandem.rl.core.registry import Registry

__all__ = [
    "PREFERENCE_LOSSES",
    "PreferenceConfig",
    "PreferenceFn",
    "PreferenceInput",
    "PreferenceOutput",
    "bradley_terry_loss",
]


@dataclass
class PreferenceInput:
    policy_chosen_logps: Tensor  # [B] summed over response tokens
    policy_rejected_logps: Tensor  # [B]
    ref_chosen_logps: Tensor | None  # [B]; None for reference-free losses
    ref_rejected_logps: Tensor | None  # [B]
    chosen_lengths: Tensor  # [B] response tokens
    rejected_lengths: Tensor  # [B]


@dataclass
class PreferenceConfig:
    """The preference losses' settings, defined and checked here once. The ``[preference]``
    config section extends this class (tandem/rl/config/schema.py `PreferenceTrainConfig`)."""

    beta: float = 0.1  # DPO ~0.1; IPO's tau; SimPO ~2.0
    label_smoothing: float = 0.0  # conservative DPO (cDPO): assumed probability a label is flipped
    margin: float = 0.5  # simpo: target reward margin (the paper's gamma)

    def __post_init__(self) -> None:
        PreferenceConfig.validate(self)

    def validate(self) -> None:
        require(self.beta > 0, f"preference.beta: must be > 0, got {self.beta}")
        require(
            0.0 <= self.label_smoothing < 0.5,
            f"preference.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}",
        )


@dataclass
class PreferenceOutput:
    loss: Tensor  # [B]
    chosen_rewards: Tensor  # [B] detached implicit reward of the chosen response
    rejected_rewards: Tensor  # [B]


PreferenceFn = Callable[[PreferenceInput, PreferenceConfig], PreferenceOutput]
PREFERENCE_LOSSES: Registry[PreferenceFn] = Registry("preference loss")


def _log_ratios(inp: PreferenceInput, name: str) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) policy/reference log-ratios, ``[B]`` each."""
    if inp.ref_chosen_logps is None or inp.ref_rejected_logps is None:
        raise ValueError(
            f"preference loss {name!r} needs the reference log-probs "
            "(ref_chosen_logps, ref_rejected_logps)"
        )
    return (
        inp.policy_chosen_logps - inp.ref_chosen_logps.detach(),
        inp.policy_rejected_logps - inp.ref_rejected_logps.detach(),
    )


def _smoothed_logistic(z: Tensor, label_smoothing: float) -> Tensor:
    """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z); ``[B]``."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@PREFERENCE_LOSSES.register("dpo", needs_reference=True)
def dpo(inp: PreferenceInput, cfg: PreferenceConfig) -> PreferenceOutput:
    """DPO (arXiv 2305.18290): -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)).

    With ``label_smoothing`` eps > 0 this is conservative DPO (cDPO, Mitchell
    2023): the labels are taken to be flipped with probability eps.
    """
    chosen, rejected = _log_ratios(inp, "dpo")
    loss = _smoothed_logistic(cfg.beta * (chosen - rejected), cfg.label_smoothing)
    return PreferenceOutput(loss, cfg.beta * chosen.detach(), cfg.beta * rejected.detach())


@PREFERENCE_LOSSES.register("ipo", needs_reference=True)
def ipo(inp: PreferenceInput, cfg: PreferenceConfig) -> PreferenceOutput:
    """IPO (arXiv 2310.12036, "A General Theoretical Paradigm to Understand Learning from
    Human Preferences"): (h - 1 / (2 beta))^2 with h the log-ratio difference.

    Follows the paper: h uses the SUMMED log-probs (some implementations
    length-normalise them; that is a different loss). ``label_smoothing`` is not
    used: IPO regresses to a fixed margin and has no logistic likelihood to smooth.
    """
    chosen, rejected = _log_ratios(inp, "ipo")
    h = chosen - rejected
    loss = (h - 1.0 / (2.0 * cfg.beta)) ** 2
    return PreferenceOutput(loss, cfg.beta * chosen.detach(), cfg.beta * rejected.detach())


@PREFERENCE_LOSSES.register("simpo", needs_reference=False)
def simpo(inp: PreferenceInput, cfg: PreferenceConfig) -> PreferenceOutput:
    """SimPO (arXiv 2405.14734): reference-free, length-normalised rewards with a target margin.

    r = beta * logp / |y|; loss = -log sigmoid(r_chosen - r_rejected - margin) (the paper's gamma).
    Departure: ``label_smoothing`` > 0 applies the cDPO smoothing (the paper
    has none; the default 0 is the paper's loss). Reference log-probs are ignored.
    """
    dtype = inp.policy_chosen_logps.dtype
    chosen = cfg.beta * inp.policy_chosen_logps / inp.chosen_lengths.clamp(min=1).to(dtype)  # [B]
    rejected = cfg.beta * inp.policy_rejected_logps / inp.rejected_lengths.clamp(min=1).to(dtype)
    loss = _smoothed_logistic(chosen - rejected - cfg.margin, cfg.label_smoothing)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Reward-model pairwise loss -log sigmoid(s_chosen - s_rejected) (Bradley-Terry; InstructGPT,
    arXiv 2203.02155); ``[B]``."""
    return -F.logsigmoid(chosen_scores - rejected_scores)
