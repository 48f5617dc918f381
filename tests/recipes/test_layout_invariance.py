"""The same config and seed sample the same completions on 1 and 2 ranks, and a run resumed on
another world size continues the uninterrupted run's trajectory.

Each prompt's samples are keyed by (job seed, step, stream position, sample index) and a step's
prompts are the next positions of one global stream dealt over the ranks, so the completions
must agree token for token; the updates agree up to the float reassociation of a different
reduction tree (FSDP2's reduce-scatter vs one rank's sum). The runs dump every sample with
``advanced.dump_rollouts``; torchrun launches are shared through a module fixture.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tandem.rl.data.prompts import PromptStream, deal, rollout_seed
from tests.env_helpers import AGAIN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
STEPS = 5


def _run(dump: str, nproc: int, extra: tuple[str, ...] = ()) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.toml"),
        f"--model.path={POLICY}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        "--rl.prompts_per_step=8",
        "--rl.eval_prompts=8",
        "--training.eval_interval=0",
        "--metrics.loggers=[]",
        "--checkpoint.interval=2",
        "--checkpoint.keep_last=5",
        "--advanced.dump_rollouts=true",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]


def _rollouts(dump: str, field: str = "completion_ids") -> dict[tuple[int, int], list[list]]:
    """(step, prompt position) -> its completions (or ``field``) in sample order, merged over the
    ranks' dumps."""
    out: dict[tuple[int, int], list[list]] = {}
    for path in sorted(glob.glob(os.path.join(dump, "rollouts", "rank-*.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            out.setdefault((r["step"], r["prompt"]), []).append(r[field])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    out = {"one": _run(str(base / "one"), 1), "two": _run(str(base / "two"), 2)}
    # the same 2 ranks generating as one group over sharded weights (rollout.tp = 2,
    # tandem/parallel/generation_layout.py)
    out["two_gen_tp2"] = _run(
        str(base / "two_gen_tp2"), 2, ("--rollout.tp=2", "--checkpoint.enable=false")
    )
    resumed = base / "resumed"  # the 2-rank run's step-2 checkpoint, continued on 1 rank
    shutil.copytree(base / "two" / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    out["resumed"] = _run(str(resumed), 1)
    for name, n in (("one_exact", 1), ("two_exact", 2)):
        out[name] = _run(str(base / name), n, ("--rl.exact=true",))
    # multi-turn agentic episodes (tests/env_helpers.py's "again" env), two epochs: the old
    # log-probs are recomputed in the update layout
    out["agentic_exact"] = _run(
        str(base / "agentic_exact"),
        2,
        (
            "--rl.exact=true",
            "--rl.epochs=2",
            *AGAIN_FLAGS,
            "--checkpoint.enable=false",
            "--training.steps=2",
        ),
    )
    return base, out


@pytest.mark.slow
def test_one_and_two_ranks_sample_the_same_completions(runs):
    base, rows = runs
    one, two = _rollouts(str(base / "one")), _rollouts(str(base / "two"))
    assert {s for s, _ in one} == set(range(1, STEPS + 1))
    assert len(one) == STEPS * 8 and one.keys() == two.keys()
    assert all(len(v) == 8 for v in one.values())  # rl.num_samples completions per prompt
    assert one == two  # token for token, every step
    for a, b in zip(rows["one"], rows["two"], strict=True):
        assert a["reward/total"] == b["reward/total"]
        assert a["response/length_mean"] == b["response/length_mean"]
        # measured (fp32, CPU): loss within 1.3e-6 and grad norm within 2.1e-6 relative over the
        # 5 steps; not bitwise: the gradient sums over ranks follow another reduction tree
        assert abs(a["loss"] - b["loss"]) <= 5e-6 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-6 * b["grad_norm"], (
            a["grad_norm"],
            b["grad_norm"],
        )


@pytest.mark.slow
def test_a_sharded_generation_layout_samples_the_same_completions(runs):
    """rollout.tp = 2: one generator over both ranks' weight shards (the group's all-reduces sum
    in another order than one rank's matmuls), the same per-prompt seeds: the same completions
    as one rank, every step (measured: 40 of 40 prompt groups equal over 5 steps)."""
    base, rows = runs
    one, sharded = _rollouts(str(base / "one")), _rollouts(str(base / "two_gen_tp2"))
    assert len(one) == STEPS * 8 and sharded == one
    assert all(r["reshard/gb"] > 0 for r in rows["two_gen_tp2"])


@pytest.mark.slow
def test_two_rank_run_resumed_on_one_rank_continues_its_completions(runs):
    base, rows = runs
    two, resumed = _rollouts(str(base / "two")), _rollouts(str(base / "resumed"))
    assert [r["step"] for r in rows["resumed"]] == [3, 4, 5]
    later = {k: v for k, v in two.items() if k[0] > 2}
    assert len(later) == 3 * 8 and resumed == later


def test_stream_union_over_ranks_does_not_depend_on_their_number():
    """Every rank takes the same global positions; the ranks' deals partition them, and a
    rank's contiguous halves are the global list's halves' share (minibatches line up)."""
    ref = PromptStream(10, seed=3).take(24)  # 2.4 epochs of 10 rows
    assert sorted(i for _, i in ref[:10]) == list(range(10))  # an epoch is a permutation
    assert ref[:10] != ref[10:20]  # reshuffled per epoch
    for dp in (1, 2, 4):
        stream = PromptStream(10, seed=3)
        taken = stream.take(16) + stream.take(8)  # a step, then a refill round
        assert taken == ref and stream.cursor == 24
        shares = [deal(taken[:16], r, dp) for r in range(dp)]
        assert sorted(x for s in shares for x in s) == sorted(taken[:16])
        first_half = sorted(x for s in shares for x in s[: len(s) // 2])
        assert first_half == sorted(taken[:8])
    resumed = PromptStream(10, seed=3, cursor=16)
    assert resumed.take(8) == ref[16:]


def test_rollout_seed_is_a_pure_function_of_seed_step_and_position():
    seeds = {rollout_seed(0, step, pos) for step in range(20) for pos in range(200)}
    assert len(seeds) == 20 * 200  # distinct per (step, prompt)
    assert rollout_seed(0, 3, 7) == rollout_seed(0, 3, 7) != rollout_seed(1, 3, 7)
    assert all(0 <= s < 1 << 62 for s in seeds)


@pytest.mark.slow
def test_exact_mode_is_bitwise_on_policy_on_any_layout(runs):
    """rl.exact: the gap is 0 on every token every step (single-turn on 1 and 2 ranks, multi-turn
    episodes with recomputed old log-probs); step 1's generator log-probs are the same bits on 1
    and 2 ranks; later steps' differ only through the weights (the update's reduction tree)."""
    base, rows = runs
    for name in ("one_exact", "two_exact", "agentic_exact"):
        assert rows[name], name
        for r in rows[name]:
            assert r["gap/abs_max"] == 0.0 and r["gap/tokens_differ"] == 0.0, (name, r["step"])
    for name in ("one", "two"):  # the control: without exact mode some tokens' log-probs differ
        assert any(r["gap/tokens_differ"] > 0 for r in rows[name]), name
    assert max(r["env/turns_mean"] for r in rows["agentic_exact"]) > 1
    one, two = _rollouts(str(base / "one_exact")), _rollouts(str(base / "two_exact"))
    assert one == two == _rollouts(str(base / "one"))  # the same completions with exact on or off
    lp1, lp2 = (
        _rollouts(str(base / "one_exact"), "gen_logprobs"),
        _rollouts(str(base / "two_exact"), "gen_logprobs"),
    )
    assert {k: v for k, v in lp1.items() if k[0] == 1} == {
        k: v for k, v in lp2.items() if k[0] == 1
    }
    for a, b in zip(rows["one_exact"], rows["two_exact"], strict=True):
        # measured: loss within 9e-8 and grad norm within 1.6e-7 relative (bitwise at some steps)
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * b["grad_norm"], (
            a["grad_norm"],
            b["grad_norm"],
        )
