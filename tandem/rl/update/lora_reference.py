"""The reference model of a LoRA run: the policy itself with its adapters off.

With adapters (``[lora]``) the frozen base is exactly the initial policy, so the KL
reference needs no second copy of the model: `BaseReference` answers ``logprobs``
like a frozen policy (tandem/rl/update/policy.py) by running the policy's own forward
inside `tandem.models.lora.adapters_disabled`. The policy's MoE routing check compares the
rollout's experts with the update's (with adapters on); it is held off during this pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.models.lora import adapters_disabled, has_lora


class BaseReference:
    """``logprobs(samples, width)`` of ``policy``'s base (adapters off), no autograd."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def logprobs(self, samples: list[Any], width: int) -> torch.Tensor:
        routing = self.policy.routing
        armed, routing.samples = routing.samples, None  # the base's experts are not the rollout's
        try:
            with adapters_disabled(self.policy.modules):
                return self.policy.logprobs(samples, width)
        finally:
            routing.samples = armed


def frozen_reference(policy: Any, build: Callable[[], Any]) -> Any:
    """The KL reference model: with adapters, ``policy``'s base (`BaseReference`); else ``build()``,
    a frozen copy of the initial policy."""
    return BaseReference(policy) if has_lora(policy.state_module) else build()
