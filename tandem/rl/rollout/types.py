"""What a rollout hands to the update phase: one record per sampled completion.

Single-turn generation and multi-turn agentic episodes both produce
`RolloutSample`s, so rewards, advantages and the update never care which made
them. Per-token lists cover the completion (everything after the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutSample:
    group: int  # index of the prompt within the step's batch (GRPO group)
    prompt_ids: list[int]
    completion_ids: list[int]  # sampled and environment tokens, in order
    loss_mask: list[bool]  # per completion token: True where the policy sampled it
    gen_logprobs: list[float]  # per completion token: generator raw log-prob (0.0 where not sampled)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str  # decoded completion
    row: dict[str, Any]  # the dataset row (ground truth, task, id, ...)
    env_reward: float | None = None  # reward an environment gave at the end of an episode
    info: dict[str, float] = field(default_factory=dict)  # per-episode metrics (turns, tool calls, ...)
    routing: Any = None  # MoE: [C, L, k] int16 experts the rollout chose for the inputs of each completion token
    images: Any = None  # the prompt's tandem.models.vlm.PromptImages (its M-RoPE positions), the object the rollout used

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)
