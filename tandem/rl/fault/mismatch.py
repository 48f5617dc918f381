"""The mismatch contract (``rl.max_mismatch_kl``): a run whose generator and update disagree too
much, on average over a window of steps, stops with `EXIT_MISMATCH` (12).

Each step's ``gap/k3`` (tandem/rl/update/loss.py `gap_metrics`: the k3 estimate of
KL(generator || update) over the sampled tokens, the same on every rank) joins a window of the
last ``rl.mismatch_window`` steps; once the window is full, a mean above the limit raises
`MismatchError` on every rank at the same step. The window is part of the recipe's state, so a
resumed run stops where the uninterrupted one would. prime-rl's review rule is 0.015 over 20
steps; a low-bit rollout without ``rl.quantize_update`` is what this guards (docs/low-precision.md).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tandem.rl.core.errors import MismatchError

KEY = "gap/k3"


class MismatchGuard:
    """A sliding window of the last ``window`` steps' ``gap/k3`` against ``limit``."""

    def __init__(self, limit: float, window: int) -> None:
        self.limit, self.window = limit, window
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Add step ``step``'s (0-based) mismatch; `MismatchError` when a full window's mean is
        above the limit. Adds ``gap/k3_window_mean`` to ``metrics``."""
        self.values.append(float(metrics[KEY]))
        mean = sum(self.values) / len(self.values)
        metrics["gap/k3_window_mean"] = mean
        if len(self.values) == self.window and mean > self.limit:
            raise MismatchError(
                f"rl.max_mismatch_kl: the generator/update mismatch (gap/k3) averaged {mean:.4g} "
                f"over steps {step + 2 - self.window}..{step + 1}, above the limit {self.limit:g} "
                "(rl.mismatch_window = "
                f"{self.window}); see docs/low-precision.md (rl.quantize_update)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = deque(state.get("values", []), maxlen=self.window)
