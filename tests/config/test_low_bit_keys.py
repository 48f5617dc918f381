"""The low-bit rollout keys (rollout.weight_dtype, rl.quantize_update, rl.max_mismatch_kl,
rl.mismatch_window): each bad value is one ConfigError line naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.rl.config.schema import ConfigError, load_config

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml")


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["rl.quantize_update=true"], "rl.quantize_update: needs a low-bit generation copy"),
        (["rollout.weight_dtype=int3"], "rollout.weight_dtype"),
        (["rl.max_mismatch_kl=-1"], "rl.max_mismatch_kl: must be >= 0, got -1"),
        (["rl.mismatch_window=0"], "rl.mismatch_window: must be >= 1, got 0"),
    ],
)
def test_bad_values_name_their_key(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError, match=line.replace("(", r"\(")):
        load_config(QUICKSTART, overrides)


def test_good_values_load() -> None:
    cfg = load_config(
        QUICKSTART,
        ["rollout.weight_dtype=w4a16", "rl.quantize_update=true", "rl.max_mismatch_kl=0.015"],
    )
    assert cfg.rollout.weight_dtype == "w4a16" and cfg.rl.mismatch_window == 20


def test_a_layout_that_cuts_the_blocks_is_refused() -> None:
    """The quickstart policy's q projection (64 rows) over rollout.tp = 2: 32 rows per rank cut
    fp8_block's 128-row blocks (one row of the table of what composes); w4a16's do not."""
    with pytest.raises(ConfigError, match=r"^rollout.weight_dtype: a weight format whose blocks"):
        load_config(QUICKSTART, ["rollout.weight_dtype=fp8_block", "rollout.tp=2"])
    load_config(QUICKSTART, ["rollout.weight_dtype=w4a16", "rollout.tp=2"])
