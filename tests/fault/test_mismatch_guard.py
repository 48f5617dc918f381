"""`MismatchGuard` (rl.max_mismatch_kl): a full window's mean above the limit raises, a partial
window never does, the window slides, and its state round-trips (a resumed run stops where the
uninterrupted one would). The end-to-end drill (exit 12): tests/recipes/test_quantized_rollout.py.
"""

from __future__ import annotations

import pytest

from tandem.rl.core.errors import MismatchError
from tandem.rl.fault.mismatch import MismatchGuard


def test_window_mean_against_the_limit() -> None:
    g = MismatchGuard(limit=0.015, window=3)
    seen = []
    for step, v in enumerate([0.04, 0.001, 0.001, 0.001, 0.02]):  # means: -, -, 0.014, 0.001, ...
        m = {"gap/k3": v}
        g.observe(step, m)
        seen.append(m["gap/k3_window_mean"])
    assert seen == pytest.approx([0.04, 0.0205, 0.014, 0.001, 0.022 / 3])
    with pytest.raises(
        MismatchError, match=r"averaged 0.02 over steps 4..6, above the limit 0.015"
    ):
        g.observe(5, {"gap/k3": 0.039})  # (0.001 + 0.02 + 0.039) / 3 = 0.02


def test_state_round_trip_stops_at_the_same_step() -> None:
    a = MismatchGuard(limit=0.01, window=2)
    a.observe(0, {"gap/k3": 0.015})
    b = MismatchGuard(limit=0.01, window=2)
    b.load_state_dict(a.state_dict())
    for g in (a, b):
        with pytest.raises(MismatchError, match="over steps 1..2"):
            g.observe(1, {"gap/k3": 0.006})
