"""Learning-rate schedule against its closed form."""

import math

from tandem.rl.core.optim import lr_factor


def test_warmup_then_cosine():
    kw = dict(total_steps=110, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, **kw) == 0.1
    assert lr_factor(9, **kw) == 1.0
    assert lr_factor(10, **kw) == 1.0
    assert math.isclose(lr_factor(60, **kw), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(110, **kw), 0.1)


def test_linear_and_constant():
    assert math.isclose(
        lr_factor(5, total_steps=10, warmup_steps=0, decay="linear", min_lr_ratio=0.0), 0.5
    )
    assert lr_factor(7, total_steps=10, warmup_steps=0, decay="constant", min_lr_ratio=0.0) == 1.0
