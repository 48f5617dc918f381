"""Checkpoint commit protocol and exact state round-trip (world of one)."""

import os
import time

import torch
import torch.nn as nn

from tandem.parallel.distributed import init_distributed
from tandem.rl.core.checkpoint import Checkpointer, committed_steps
from tandem.rl.core.checkpoint_sums import MARKER


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


def test_async_save_commits_when_written_and_keeps_the_state_of_its_step(tmp_path):
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path), keep_last=2, async_save=True)
    m, opt = _model_and_opt(0)
    at_save = {k: v.clone() for k, v in m.state_dict().items()}
    t0 = time.monotonic()
    blocked = ck.save(3, m, opt, {"step": 3})
    # the call's own time, not the write's
    assert ck.pending_step == 3 and 0 < blocked <= time.monotonic() - t0
    # not committed before the write is known to be done
    assert committed_steps(str(tmp_path)) == []
    with torch.no_grad():  # training goes on while the write runs: the checkpoint must not see it
        for p in m.parameters():
            p.add_(1.0)
    total = ck.wait()
    assert total is not None and total >= blocked and ck.pending_step is None
    assert committed_steps(str(tmp_path)) == [3] and ck.wait() is None
    m2, opt2 = _model_and_opt(1)
    ck.load(3, m2, opt2)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, at_save[k]), k
    # poll() commits once the write is done; a new save finishes the previous one first
    ck.save(4, m, opt, {"step": 4})
    ck.save(5, m, opt, {"step": 5})
    assert committed_steps(str(tmp_path)) == [3, 4]
    while ck.poll() is None:
        pass
    assert committed_steps(str(tmp_path)) == [4, 5]


def test_model_only_checkpoint_holds_weights_and_leaves_the_optimizer(tmp_path):
    init_distributed(force_cpu=True)
    full, light = (
        Checkpointer(str(tmp_path / "full")),
        Checkpointer(str(tmp_path / "light"), model_only=True),
    )
    m, opt = _model_and_opt(0)
    full.save(1, m, opt, {"step": 1})
    light.save(1, m, opt, {"step": 1})

    def size(p):
        return sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(p)
            for f in fs
            if f.startswith("__")
        )

    assert size(light.path(1)) < size(full.path(1)) / 2  # AdamW keeps two tensors per parameter
    m2, opt2 = _model_and_opt(1)
    before = {
        k: {n: torch.as_tensor(t).clone() for n, t in v.items()}
        for k, v in opt2.state_dict()["state"].items()
    }
    state = light.load(1, m2, opt2)
    assert state["_model_only"] is True and full.load(1, *_model_and_opt(2))["_model_only"] is False
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    for k, v in opt2.state_dict()["state"].items():  # untouched: a resume restarts the optimizer
        for n, t in v.items():
            assert torch.equal(torch.as_tensor(t), before[k][n])
