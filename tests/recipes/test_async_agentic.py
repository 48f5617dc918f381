"""Multi-turn episodes (env.name) in both asynchronous modes, end to end (torchrun, CPU).

- ``max_staleness = 0`` with ``rl.exact``: configs/quickstart_agentic.toml (the python tool in
  the code sandbox) in ``colocated_async`` (2 ranks) and ``split`` (1 generator, 2 trainers)
  samples the synchronous run's episodes token for token, with the same log-probs, and logs the
  same losses and rewards, bit for bit;
- ``max_staleness = 1`` with slow tools (TANDEM_INJECT_TOOL_DELAY): turns span weight updates
  (a completion's tokens carry two versions), no token trains more than one version late,
  and a rank killed (-9) while tool calls are in flight (under torchrun --max-restarts)
  resumes with every prompt trained exactly once; the code sandbox leaves no work directory.
"""

import json
import os
import subprocess
import time

import pytest

from tests.env_helpers import AGAIN_FLAGS
from tests.fixtures import assert_same_as_synchronous, quickstart_cmd, rollout_dumps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPLIT = ("--rollout.mode=split", "--rollout.gen_ranks=1")
COLOCATED = ("--rollout.mode=colocated_async",)
SLOW_TOOLS = {"TANDEM_INJECT_TOOL_DELAY": "1.2:0.01:0.3"}
STALE_1 = (
    "--rollout.max_staleness=1",
    "--rollout.suspended_kv=recompute",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last=3",
)
# the 'again' environment (tests/env_helpers.py): two turns, no sandbox, seconds a step
AGAIN = (*AGAIN_FLAGS, "--env.num_workers=4")


def _run(dump, *extra, steps=2, nproc=2, env=None, config="quickstart_agentic.toml"):
    per_step = ("--rl.prompts_per_step=8",) if config == "quickstart_agentic.toml" else ()
    cmd = [*quickstart_cmd(dump, steps, nproc, config=config), *per_step, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """The agentic quickstart for 2 steps with rl.exact: synchronous, colocated and split."""
    base = tmp_path_factory.mktemp("agentic_async")
    flags = ("--rl.exact=true", "--rl.eval_prompts=4", "--checkpoint.enable=false")
    return {
        "sync": (base / "sync", _run(base / "sync", *flags)),
        "colocated": (base / "colocated", _run(base / "colocated", *flags, *COLOCATED)),
        "split": (base / "split", _run(base / "split", *flags, *SPLIT, nproc=3)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_staleness_zero_plays_the_synchronous_episodes(exact, mode):
    sync = exact["sync"][1]
    assert all(r["env/tool_calls_per_episode"] > 0 for r in sync)  # the sandbox ran
    keys = ("loss", "grad_norm", "entropy", "reward/total", "gap/abs_mean")
    if mode == "colocated":  # rank 0's episodes (split's rank 0 holds every episode)
        keys += ("env/tool_calls_per_episode", "env/turns_mean")
    assert_same_as_synchronous(exact["sync"], exact[mode], 2 * 8 * 8, keys)


def _bound_held(dump, steps, prompts):
    samples = rollout_dumps(dump)
    for r in samples:
        assert r["versions"] == sorted(r["versions"]) and max(r["versions"]) <= r["step"] - 1
        assert r["step"] - 1 - min(r["versions"]) <= 1
        assert len(r["versions"]) == len(r["completion_ids"])
    assert any(len(set(r["versions"])) > 1 for r in samples)  # a turn spanned an update
    ledger = [json.loads(line) for line in open(dump / "ledger.jsonl")]
    assert [row["step"] for row in ledger] == list(range(1, steps + 1))
    positions = [p for row in ledger for p in row["positions"]]
    assert len(positions) == len(set(positions)) == steps * prompts  # every prompt trained once


@pytest.mark.slow
def test_a_kill_mid_turn_trains_every_prompt_once_and_leaves_no_sandbox(tmp_path):
    """colocated_async, S = 1, slow tools: rank 1 dies after step 3's update while episodes wait
    on their tools; the restart resumes from step 2 (the groups in flight there are played
    afresh) and finishes with the bound held."""
    tmp = tmp_path / "tmp"  # where the sandboxes make their work directories
    tmp.mkdir()
    env = {**SLOW_TOOLS, "TANDEM_INJECT_KILL": "3:1", "TMPDIR": str(tmp)}
    rows = _run(tmp_path / "run", *COLOCATED, *STALE_1, "--rl.eval_prompts=4", steps=5, env=env)
    assert (tmp_path / "run" / "fault" / "killed-step-3-rank-1").exists()
    assert [r["step"] for r in rows][-3:] == [3, 4, 5]
    _bound_held(tmp_path / "run", 5, 8)
    deadline = time.monotonic() + 30  # a killed rank's env worker ends its step, then exits
    while any(tmp.glob("tandem-sbx-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list(tmp.glob("tandem-sbx-*"))


@pytest.mark.slow
def test_split_trains_turns_that_span_updates_and_survives_a_killed_generator(tmp_path):
    """split, S = 1, slow tools: the generator (rank 0) dies after step 3; every prompt still
    trains once within the bound."""
    env = {**SLOW_TOOLS, "TANDEM_INJECT_KILL": "3:0"}
    extra = (*SPLIT, *AGAIN, *STALE_1, "--rl.eval_prompts=4")
    _run(tmp_path / "run", *extra, steps=4, nproc=3, env=env, config="quickstart.toml")
    assert (tmp_path / "run" / "fault" / "killed-step-3-rank-0").exists()
    _bound_held(tmp_path / "run", 4, 16)
