"""Multi-turn episodes in a generation group (rollout.tp = 2), against rollout.tp = 1.

One torchrun launch of tests/rollout/agentic_group_worker.py per module (2 CPU ranks, gloo):
assets/agentic-policy plays the "tool" environment with the sandboxed python tool
(as "tool_pid", which logs the pid that ran each step), first each rank alone on a
whole copy (tp = 1, the reference), then both ranks as one generation group over
weight shards (tp = 2), where only the leader has an env pool.

Sampled, not greedy: greedy, this policy never calls the tool (P(<tool_call>) at the
first assistant token is at most 0.28 on 64 prompts), so greedy episodes are single
turns; its tool episodes come from sampling with per-prompt seeds, as the recipe
samples. Tokens then agree as long as the two layouts' logits do to far below the
sampler's resolution (fp32; they differ only in the group's all-reduce order).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "rollout" / "agentic_group_worker.py"
SAME = ("prompt", "completion", "mask", "turns", "tool_calls", "reward", "finish", "group", "row")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("agentic_group")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        "--out",
        str(tmp / "out.pt"),
        "--log-dir",
        str(tmp),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(
            f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    logs = {}
    for phase in ("tp1", "tp2", "greedy_tp1", "greedy_tp2"):
        path = tmp / f"{phase}.log"
        logs[phase] = (
            [int(line.split()[0]) for line in path.read_text().splitlines()]
            if path.exists()
            else []
        )
    return {"ranks": torch.load(tmp / "out.pt", weights_only=False), "logs": logs}


def test_group_plays_the_same_episodes_as_tp1(run):
    """Per rank, the episodes of its own prompts: same tokens, loss masks, turn and tool-call
    counts, rewards and finish reasons as the rank alone on a whole copy; log-probs to
    fp32 noise."""
    multi_turn = 0
    for rank in run["ranks"]:
        ref, got = rank["tp1"]["episodes"], rank["tp2"]["episodes"]
        assert len(got) == len(ref) > 0
        for a, b in zip(ref, got):
            assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
            assert torch.allclose(
                torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-4, rtol=0
            )
            if a["turns"] > 1:
                # a tool turn: its result is context (mask False) between sampled turns
                multi_turn += 1
                assert a["tool_calls"] >= 1 and False in a["mask"] and a["mask"][-1]
    assert multi_turn >= 4  # 8 of the 24 episodes call the tool (measured)


def test_tools_ran_once_per_group_on_the_leader(run):
    """tp = 2: every environment step ran once, in the leader's env pool, and there were as many
    as the ranks' own tp = 1 episodes took turns; the other rank has no pool at all."""
    leader, other = run["ranks"]
    steps = int(sum(e["turns"] for rank in run["ranks"] for e in rank["tp1"]["episodes"]))
    assert run["logs"]["tp2"] == [leader["pid"]] * steps
    assert (
        leader["tp2"]["metrics"]["env/env_steps"]
        == other["tp2"]["metrics"]["env/env_steps"]
        == steps
    )
    assert other["pool_steps"] is None
    assert leader["pool_steps"] == steps + len(run["logs"]["greedy_tp2"])
    # tp = 1: each rank stepped its own episodes
    assert Counter(run["logs"]["tp1"]) == {
        rank["pid"]: sum(e["turns"] for e in rank["tp1"]["episodes"]) for rank in run["ranks"]
    }


def test_a_group_member_without_prompts(run):
    """Greedy, rank 1 with no prompts (an evaluation's last rank can have none): it takes part in
    the group's generator and gets nothing back; rank 0's episodes equal its tp = 1 ones, and both
    ranks report the group's episodes in env/*."""
    leader, other = run["ranks"]
    assert other["greedy_tp2"]["episodes"] == [] and other["greedy_tp1"]["episodes"] == []
    ref, got = leader["greedy_tp1"]["episodes"], leader["greedy_tp2"]["episodes"]
    assert [{k: e[k] for k in SAME} for e in got] == [{k: e[k] for k in SAME} for e in ref]
    assert len(ref) == 16 and leader["greedy_tp2"]["metrics"]["env/episodes"] == 16
    assert other["greedy_tp2"]["metrics"]["env/episodes"] == 16
    assert run["logs"]["greedy_tp2"] == [leader["pid"]] * int(sum(e["turns"] for e in ref))
