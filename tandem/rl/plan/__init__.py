"""The memory planner behind ``train.py --config X --plan`` (docs/scaling.md).

planner.py   per-rank bytes of each phase, whether a layout fits, the smallest that does
moe.py       the mixture-of-experts terms
"""
