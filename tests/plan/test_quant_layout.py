"""Which generation layouts cut a weight format's blocks (tandem/parallel/quant_layout.py), by
hand for the quickstart policy (hidden 64, 4 query heads and 2 KV heads of 16, MLP 128)."""

from __future__ import annotations

from pathlib import Path

from tandem.kernels.weight_quant import FORMATS
from tandem.models.hf import load_args
from tandem.parallel.quant_layout import cut_block

ARGS = load_args(str(Path(__file__).resolve().parents[2] / "assets" / "quickstart-policy"))


def test_cut_blocks_by_hand() -> None:
    assert all(cut_block(ARGS, 1, f) is None for f in FORMATS.values())
    # tp = 2: q is 64 rows -> 32 per rank (128-row blocks cut); o's 64 inputs -> 32 per rank
    assert cut_block(ARGS, 2, FORMATS["fp8_block"]) == (
        "layers.0.attention.wq.weight splits into 32 rows per rank, not a multiple of "
        "fp8_block's 128"
    )
    assert cut_block(ARGS, 2, FORMATS["mxfp8"]) is None  # 32 inputs per rank of o: one block
    assert cut_block(ARGS, 2, FORMATS["w4a16"]) is None
    # tp = 4: o's 64 inputs -> 16 per rank: mxfp8's 32 cut, w4a16's 16 not
    assert "attention.wo.weight splits into 16 inputs" in cut_block(ARGS, 4, FORMATS["mxfp8"])
    assert cut_block(ARGS, 4, FORMATS["w4a16"]) is None
