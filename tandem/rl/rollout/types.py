"""What a rollout hands to the update phase: one `RolloutBatch` of `RolloutSample`s.

Single-turn generation and multi-turn agentic episodes both produce
`RolloutSample`s, so rewards, advantages and the update never care which made
them. Per-token lists cover the completion (everything after the prompt). Every
sampled token carries the policy version that sampled it (the number of updates
its weights had had), so an update knows how stale each sample is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.rl.core.metrics import Tally


@dataclass
class RolloutSample:
    group: int  # index of the prompt within the step's batch (GRPO group)
    prompt_ids: list[int]
    completion_ids: list[int]  # sampled and environment tokens, in order
    loss_mask: list[bool]  # per completion token: True where the policy sampled it
    # per completion token: generator raw log-prob (0.0 where not sampled)
    gen_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str  # decoded completion
    row: dict[str, Any]  # the dataset row (ground truth, task, id, ...)
    env_reward: float | None = None  # reward an environment gave at the end of an episode
    info: dict[str, float] = field(default_factory=dict)  # per-episode metrics (turns, tool calls,
    # ...)
    routing: Any = None  # MoE: [C, L, k] int16 experts the rollout chose for the inputs of each
    # completion token
    # per completion token: the policy version that sampled it (environment tokens: the
    # version when they were appended); empty when not recorded
    versions: list[int] = field(default_factory=list)
    # the prompt's tandem.models.vlm.PromptImages (its M-RoPE positions), the object the
    # rollout used
    images: Any = None

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def first_version(self) -> int:
        """The oldest policy version among the sampled tokens (-1 when none was sampled)."""
        return min(self.versions, default=-1)

    @property
    def last_version(self) -> int:
        return max(self.versions, default=-1)


@dataclass
class RolloutBatch:
    """One update's input, this rank's share: the samples (with their behaviour log-probs
    ``gen_logprobs`` and per-token versions), their total rewards, the policy version the
    update trains (the step), and the rollout's metrics."""

    samples: list[RolloutSample]
    scores: torch.Tensor  # [N] float32, one total reward per sample
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)  # the prompt ids it trains on (the ledger)
    positions: list[int] = field(default_factory=list)  # and their prompt-stream positions


def response_tally(samples: list[RolloutSample], tally: Tally | None = None) -> Tally:
    """The sample metrics of every rollout mode, this rank's share (`Tally.reduce` over the
    ranks that hold the step's samples combines them): response lengths, truncations and
    accuracy."""
    tally = Tally() if tally is None else tally
    for s in samples:
        tally.mean("response/length_mean", len(s.completion_ids))
        tally.max("response/length_max", len(s.completion_ids))
        tally.mean("response/clipped_frac", float(s.finish_reason == "length"))
        tally.mean("accuracy", s.info.get("accuracy", 0.0))
    return tally


def staleness_tally(
    samples: list[RolloutSample], version: int, max_staleness: int, tally: Tally | None = None
) -> Tally:
    """How many versions older than ``version`` (the one the update trains) each sample's
    first token is: the maximum, the mean and a count per staleness 0 .. ``max_staleness``."""
    tally = Tally() if tally is None else tally
    for s in samples:
        stale = version - s.first_version
        tally.max("async/staleness_max", stale).mean("async/staleness_mean", stale)
        for k in range(max_staleness + 1):
            tally.sum(f"async/staleness_{k}", float(stale == k))
    return tally
