"""A payload in any file of a checkpoint never runs on resume (world of one).

Each test writes a pickle whose ``__reduce__`` creates a marker file, puts it where a
checkpoint holds a small file (RNG state, DCP's .metadata, a non-tensor DCP entry),
re-hashes the manifest the way an attacker with write access would, and loads: the
marker must not exist afterwards, and the load is one CheckpointError (exit 8) or, for a
file the manifest does not list, nothing is read at all.
"""

import hashlib
import os
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from tandem.parallel.distributed import init_distributed
from tandem.rl.core.checkpoint import Checkpointer, CheckpointError
from tandem.rl.core.checkpoint_sums import MARKER, SUMS
from tandem.rl.core.safe_load import SafePlanner, SafeReader, UnsafeCheckpointFile


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path):
    init_distributed(force_cpu=True)
    torch.manual_seed(0)
    m = nn.Linear(8, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, m, opt, {"step": 1})
    return str(tmp_path / "ck" / "step-1"), m, opt


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _rehash(step_dir, name):
    """Rewrite SHA256SUMS and the marker so that ``name`` verifies as it is now."""
    sums = os.path.join(step_dir, SUMS)
    lines = open(sums).read().splitlines()
    out = [
        f"{_sha(os.path.join(step_dir, name))}  {name}" if ln.endswith(f"  {name}") else ln
        for ln in lines
    ]
    open(sums, "w").write("\n".join(out) + "\n")
    marker = os.path.join(step_dir, MARKER)
    fields = open(marker).read().split()
    fields = [f"sha256sums={_sha(sums)}" if f.startswith("sha256sums=") else f for f in fields]
    open(marker, "w").write(" ".join(fields) + "\n")


def _rng_with_payload(marker):
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "x": _Payload(marker)}


def test_a_listed_rng_file_with_a_payload_is_refused_and_never_runs(tmp_path):
    step_dir, m, opt = _saved(tmp_path)
    marker = str(tmp_path / "ran")
    torch.save(_rng_with_payload(marker), os.path.join(step_dir, "rng", "rank-0.pt"))
    _rehash(step_dir, "rng/rank-0.pt")
    ck = Checkpointer(str(tmp_path / "ck"))
    assert ck.verify(1) is None  # the manifest agrees: only the loader stands in the way
    with pytest.raises(
        CheckpointError, match=r"rng/rank-0\.pt is not plain data \(names io\.open\)"
    ):
        ck.load(1, m, opt)
    assert not os.path.exists(marker)


def test_an_rng_file_the_manifest_does_not_list_is_never_read(tmp_path):
    """A 1-rank checkpoint resumed by rank 1 of 2: rng/rank-1.pt is not in SHA256SUMS."""
    step_dir, m, opt = _saved(tmp_path)
    marker = str(tmp_path / "ran")
    torch.save(_rng_with_payload(marker), os.path.join(step_dir, "rng", "rank-1.pt"))
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.rank = 1
    before = torch.get_rng_state()
    assert ck.load(1, m, opt)["step"] == 1
    assert not os.path.exists(marker)
    assert torch.equal(torch.get_rng_state(), before)  # rank 1 keeps its own stream


def test_rng_state_round_trips_through_the_safe_loader(tmp_path):
    step_dir, m, opt = _saved(tmp_path)
    py, tt = random.getstate(), torch.get_rng_state()  # what the save recorded (no draws since)
    random.random(), torch.rand(3)
    Checkpointer(str(tmp_path / "ck")).load(1, m, opt)
    assert random.getstate() == py and torch.equal(torch.get_rng_state(), tt)


def test_dcp_metadata_with_a_payload_is_refused_and_never_runs(tmp_path):
    step_dir, m, opt = _saved(tmp_path)
    marker = str(tmp_path / "ran")
    with open(os.path.join(step_dir, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    _rehash(step_dir, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata names io\.open"):
        Checkpointer(str(tmp_path / "ck")).load(1, m, opt)
    assert not os.path.exists(marker)


def test_a_non_tensor_dcp_entry_with_a_payload_is_refused_and_never_runs(tmp_path):
    init_distributed(force_cpu=True)
    marker = str(tmp_path / "ran")
    dcp.save({"w": torch.ones(2), "x": _Payload(marker)}, checkpoint_id=str(tmp_path / "d"))
    assert not os.path.exists(marker)
    state = {"w": torch.zeros(2), "x": None}
    path = str(tmp_path / "d")
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    ((cause, _),) = info.value.failures.values()
    assert isinstance(cause, UnsafeCheckpointFile) and "entry x is not plain data" in str(cause)
    assert not os.path.exists(marker)
    # plain values still load
    dcp.save({"w": torch.ones(2), "x": 0.25}, checkpoint_id=str(tmp_path / "e"))
    state = {"w": torch.zeros(2), "x": None}
    dcp.load(state, storage_reader=SafeReader(str(tmp_path / "e")), planner=SafePlanner())
    assert state["x"] == 0.25 and torch.equal(state["w"], torch.ones(2))
