"""Checkpoint commit protocol and exact state round-trip (world of one)."""

import os

import torch
import torch.nn as nn

from parallel.distributed import init_distributed
from rl.checkpoint import MARKER, Checkpointer, committed_steps


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 3)).sum().backward()
    opt.step()
    return m, opt


def test_save_load_roundtrip_and_partial_ignored(tmp_path):
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path), keep_last=2)
    m, opt = _model_and_opt(0)
    ck.save(4, m, opt, {"step": 4, "note": "x"})
    rng_after_save = torch.rand(3)
    # an interrupted save and an uncommitted folder must be ignored
    os.makedirs(tmp_path / "step-9.partial")
    os.makedirs(tmp_path / "step-8")
    assert committed_steps(str(tmp_path)) == [4]
    assert ck.latest_step() == 4
    m2, opt2 = _model_and_opt(1)
    state = ck.load(4, m2, opt2)
    assert state["step"] == 4 and state["note"] == "x" and state["_saved_world"] == 1
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name]))
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored to the save point


def test_keep_last_prunes_old_and_partials(tmp_path):
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path), keep_last=2)
    m, opt = _model_and_opt(0)
    os.makedirs(tmp_path / "step-1.partial")
    for s in (2, 3, 5):
        ck.save(s, m, opt, {"step": s})
    assert committed_steps(str(tmp_path)) == [3, 5]
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-5"]
    assert os.path.exists(tmp_path / "step-5" / MARKER)
